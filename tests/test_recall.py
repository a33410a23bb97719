"""The ``recall`` quality task (``veloxquant eval --task recall``): the prompt layout, the rows, the
command line, and -- on the embedded SmolLM2 -- that it tells a query-aware eviction method from a
recency-only one at the same budget while the uncompressed model copies near its ceiling."""

from __future__ import annotations

import json

import pytest

from veloxquant_mlx import cli  # noqa: I001  (OpenBLAS before mlx)

from veloxquant_mlx.eval import tasks  # noqa: E402
from veloxquant_mlx.eval.recall import CUE_TOKENS, build_recall_prompt  # noqa: E402
from test_eval_bench import TEXT, CharTokenizer  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

IDS = list(range(10_000, 13_000))  # distinct "tokens": every position is recognisable


@pytest.mark.parametrize("kw", [{"depth": 0.0}, {"depth": 0.3}, {"depth": 1.0}, {"distance": 0}, {"distance": 500}])
def test_layout(kw):
    context, passage = 1000, 100
    p = build_recall_prompt(IDS, context, passage=passage, **kw)
    copy = IDS[-passage:]
    prompt = p.ids[: p.n_context]
    assert p.n_context == context and p.n_score == passage - CUE_TOKENS and len(p.ids) == context + p.n_score
    assert prompt[p.passage_index: p.passage_index + passage] == copy  # the first copy
    assert prompt[-CUE_TOKENS:] == copy[:CUE_TOKENS] and p.ids[context:] == copy[CUE_TOKENS:]  # cue, then scored
    assert p.distance == context - CUE_TOKENS - (p.passage_index + passage)
    filler = [t for t in prompt[: p.passage_index] + prompt[p.passage_index + passage: -CUE_TOKENS]]
    assert filler == IDS[: context - passage - CUE_TOKENS] and not set(filler) & set(copy)
    if "distance" in kw:
        assert p.distance == kw["distance"]
    else:
        assert p.passage_index == round(kw["depth"] * (context - passage - CUE_TOKENS))


@pytest.mark.parametrize("kw, match", [
    ({}, "exactly one"), ({"depth": 0.5, "distance": 3}, "exactly one"), ({"depth": 1.5}, "depth"),
    ({"distance": 10_000}, "distance"), ({"distance": -1}, "distance"),
    ({"depth": 0.5, "passage": 16}, "cue"), ({"depth": 0.5, "context": 100}, "too small"),
    ({"depth": 0.5, "context": 2950}, "tokens"),
])
def test_bad_layouts(kw, match):
    kw = {"context": 1000, **kw}
    with pytest.raises(ValueError, match=match):
        build_recall_prompt(IDS, kw.pop("context"), **kw)


def test_rows_on_a_tiny_model():
    model, tok = tiny_llama(seed=3, head_dim=32, n_layers=2), CharTokenizer()
    seen = []
    rows = tasks.run_eval(model, tok, [("streaming_llm", {"stream_window_size": 24})], ["recall"], context=200,
                          depths=(0.1, 0.6), text=TEXT, progress=seen.append, recall_passage=40)
    assert len(seen) == tasks.count_units(["recall"], 2, 2, n_recall=2)
    none, stream = rows
    for r in rows:
        assert tuple(r) == tasks.ROW_KEYS and r["task"] == "recall" and r["error"] is None
        assert [d["depth"] for d in r["recall_detail"]] == [pytest.approx(0.1, abs=0.01), pytest.approx(0.6, abs=0.01)]
        assert r["n_scored"] == 2 * (40 - CUE_TOKENS) and 0.0 <= r["copy_acc"] <= 1.0
        assert r["copy_acc"] == pytest.approx(sum(d["copy_acc"] for d in r["recall_detail"]) / 2)
        assert r["copy_acc_ref"] == none["copy_acc_ref"]  # the same uncompressed reference
    assert none["kld"] < 1e-4 and none["top1_agree"] == 1.0 and none["copy_acc"] == none["copy_acc_ref"]
    assert stream["kv_bytes"] < stream["kv_bytes_fp16"] < none["kv_bytes"]
    by_distance = tasks.eval_recall(model, tok, ["streaming_llm"], context=200, depths=(), distances=(5, 90),
                                    text=TEXT, passage=40, include_none=False)
    assert [d["distance"] for d in by_distance[0]["recall_detail"]] == [5, 90]
    json.dumps(rows)


def test_cli(tmp_path, capsys, monkeypatch):
    import veloxquant_mlx.model as model_mod

    tiny = tiny_llama(seed=3, head_dim=32, n_layers=2), CharTokenizer()
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: tiny)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = ["eval", "--task", "recall", "--method", "snapkv", "--set", "budget=32", "--set", "obs_window=8",
            "--text-file", str(text), "--context", "160", "--passage", "32"]
    assert cli.main(base + ["--distances", "10,60", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["none", "snapkv"]
    assert [d["distance"] for d in rows[1]["recall_detail"]] == [10, 60]
    assert cli.main(base) == 0
    assert "copy " in capsys.readouterr().out
    for bad in (["--passage", "16"], ["--distances", "-3"], ["--distances", "2.5"]):
        assert cli.main(base + bad) == 2
        assert "--" in capsys.readouterr().err


@pytest.mark.real_model
def test_recall_tells_query_aware_eviction_from_recency():
    """SmolLM2-135M, 1024-token context, the passage at depth 0.1, a 25% budget: the uncompressed model
    copies the repeat near its ceiling; SnapKV (the cue's queries vote for the first copy) keeps it and
    copies far more of it than StreamingLLM (sinks + the most recent rows, which lost the first copy).
    Measured on the 2-core CPU machine: copy 0.964 uncompressed, snapkv 0.616 (KLD 1.78), streaming_llm
    0.393 (KLD 2.90); the margins asserted are about half the measured gaps."""
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    rows = tasks.eval_recall(model, tok, [("snapkv", {"snap_budget": 256}),
                                          ("streaming_llm", {"stream_window_size": 252})],
                             context=1024, depths=(0.1,))
    none, snap, stream = rows
    assert none["copy_acc_ref"] >= 0.85 and none["copy_acc"] == none["copy_acc_ref"]
    assert snap["kv_fraction_of_fp16"] < 0.5 and stream["kv_fraction_of_fp16"] < 0.5
    assert snap["copy_acc"] >= stream["copy_acc"] + 0.12, (snap["copy_acc"], stream["copy_acc"])
    assert snap["kld"] < stream["kld"] - 0.5, (snap["kld"], stream["kld"])
