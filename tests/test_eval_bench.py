"""The quality harness (``veloxquant_mlx.eval``) and the benchmark (``veloxquant_mlx.bench``), and their
``veloxquant eval`` / ``veloxquant bench`` subcommands.

Fast: the tasks run on a tiny random-weight Llama with a character-level tokenizer; the benchmark on
the ``tiny`` shape with tiny contexts. The two ``real_model`` tests use the embedded SmolLM2-135M
(tokenizer + a short ``eval --task kld`` on a small text file).
"""

from __future__ import annotations

import json
import struct

import pytest

from veloxquant_mlx import cli  # noqa: I001  (imports veloxquant_mlx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache  # noqa: E402

from veloxquant_mlx import bench, cli_measure  # noqa: E402
from veloxquant_mlx.eval import plot, tasks  # noqa: E402
from veloxquant_mlx.eval.specs import MethodSpec, implemented_mlx_lm_methods, resolve_methods  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

TEXT = " ".join(f"Sentence number {i} is about apples, rivers and the quiet sea." for i in range(80))


class CharTokenizer:
    """One token per ASCII character (ids 1..127; 0 is EOS); no chat template."""

    bos_token = None
    chat_template = None
    eos_token_ids = {0}

    def encode(self, text, add_special_tokens=True):
        return [max(1, min(ord(c), 127)) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=3, head_dim=32, n_layers=2), CharTokenizer()


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- rows


def test_fidelity_rows_keys_and_arithmetic(tiny):
    model, tok = tiny
    memo = {}
    methods = [("kivi", {"bit_width_inlier": 4}), ("streaming_llm", {"stream_window_size": 32})]
    ppl = tasks.eval_ppl(model, tok, methods, context=96, n_score=8, text=TEXT, memo=memo)
    kld = tasks.eval_kld(model, tok, methods, context=96, n_score=8, text=TEXT, memo=memo)
    assert [r["method"] for r in ppl] == ["none", "kivi", "streaming_llm"]
    assert [r["task"] for r in ppl] == ["ppl"] * 3 and [r["task"] for r in kld] == ["kld"] * 3
    for r in ppl + kld:
        assert tuple(r) == tasks.ROW_KEYS
        assert r["error"] is None and r["context"] == 96 and r["n_scored"] == 8
        assert r["ppl_delta"] == pytest.approx(r["ppl"] - r["ppl_ref"])
        assert r["kv_fraction_of_fp16"] == pytest.approx(r["kv_bytes"] / r["kv_bytes_fp16"])
        assert 0.0 <= r["top1_agree"] <= 1.0 and r["kld"] >= -1e-6
        assert r["niah_acc"] is None
    none = ppl[0]
    assert none["kld"] < 1e-5 and none["top1_agree"] == 1.0 and none["settings"] == {}
    assert ppl[1]["settings"] == {"bit_width_inlier": 4} and ppl[1]["label"] == "kivi bit_width_inlier=4"
    # eval_kld reused eval_ppl's runs (same numbers, no recomputation)
    for a, b in zip(ppl, kld):
        assert (a["kld"], a["ppl"], a["kv_bytes"]) == (b["kld"], b["ppl"], b["kv_bytes"])
    # 95 + 8 tokens: the fp16 reference is 2 layers x (K, V) x 2 heads x 103 rows x 32 x 2 bytes; mlx_lm's
    # own cache holds float32 in one 256-row step; the 32-token window holds less
    for r in ppl:
        assert r["kv_tokens"] == 103 and r["kv_bytes_fp16"] == 2 * 2 * 2 * 103 * 32 * 2
    assert none["kv_bytes"] == 2 * 2 * 2 * 256 * 32 * 4
    assert ppl[2]["kv_bytes"] < ppl[2]["kv_bytes_fp16"] < none["kv_bytes"]
    json.dumps(ppl + kld)  # JSON-serializable


def test_niah_rows_and_run_eval(tiny):
    model, tok = tiny
    seen = []
    rows = tasks.run_eval(model, tok, ["streaming_llm"], ["kld", "niah"], context=200, n_score=4,
                          depths=(0.2, 0.8), text=TEXT, progress=seen.append, max_new_tokens=4)
    assert len(seen) == tasks.count_units(["kld", "niah"], 2, 2)
    assert [(r["method"], r["task"]) for r in rows] == [("none", "kld"), ("streaming_llm", "kld"),
                                                        ("none", "niah"), ("streaming_llm", "niah")]
    for r in rows[2:]:
        assert r["niah_trials"] == 2 and r["niah_acc"] == r["niah_hits"] / 2
        assert [d["depth"] for d in r["niah_detail"]] == [0.2, 0.8]
        assert all(set(d) == {"depth", "passcode", "answer", "correct"} for d in r["niah_detail"])
        assert r["kv_bytes"] > 0 and r["kv_fraction_of_fp16"] == pytest.approx(r["kv_bytes"] / r["kv_bytes_fp16"])
    with pytest.raises(ValueError):
        tasks.run_eval(model, tok, ["kivi"], ["bogus"], context=64, text=TEXT)


def test_failing_method_is_a_row_not_a_crash(tiny, monkeypatch):
    model, tok = tiny
    from veloxquant_mlx.cache.methods.quantization import kivi as kivi_mod

    cls = next(c for c in vars(kivi_mod).values() if isinstance(c, type) and getattr(c, "method_name", "") == "kivi")

    def boom(self, *a, **k):
        raise RuntimeError("kernel missing")

    monkeypatch.setattr(cls, "update_and_fetch", boom)
    rows = tasks.eval_kld(model, tok, ["kivi"], context=32, n_score=2, text=TEXT)
    assert rows[0]["error"] is None
    assert rows[1]["error"] == "RuntimeError: kernel missing" and rows[1]["kld"] is None


def test_text_too_short(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="tokens"):
        tasks.text_tokens(tok, 500, "short text")
    assert len(tasks.text_tokens(tok, 500, "short text. ", repeat=True)) == 500


# --------------------------------------------------------------------------- NIAH builder


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_niah_builder_places_the_needle(depth):
    tok = CharTokenizer()
    p = tasks.build_niah_prompt(tok, 600, depth, "5821", text=TEXT)
    assert len(p.context_ids) == 600
    text = tok.decode(p.context_ids)
    needle = tasks.NEEDLE_TEMPLATE.format(code="5821")
    assert text.count(needle) == 1 and "5821" not in tok.decode(p.question_ids)
    assert tok.decode(p.context_ids[p.needle_index: p.needle_index + len(p.needle_ids)]).strip() == needle
    head = len(tok.encode(tasks.INSTRUCTION + "\n\n"))
    hay_depth = (p.needle_index - head) / (600 - head - len(p.needle_ids))
    assert abs(hay_depth - depth) < 0.1  # snapped to the nearest sentence end
    if 0 < depth < 1:
        assert text[p.needle_index - 1] in " ." or text[p.needle_index - 2] == "."
    assert tasks.QUESTION in tok.decode(p.question_ids)  # the question is not in the context
    assert tasks.QUESTION not in text
    with pytest.raises(ValueError):
        tasks.build_niah_prompt(tok, 80, 0.5, text=TEXT)


def test_extract_answer_and_passcodes():
    assert tasks.extract_answer("The passcode is 4817.") == "4817"
    assert tasks.extract_answer("4,817") == "4817"
    assert tasks.extract_answer(" 4 8 1 7\n") == "4817"
    assert tasks.extract_answer("I do not know.") is None
    assert tasks.extract_answer("Vault 12: 4817") == "12"  # the first number counts
    codes = tasks.passcodes(3, seed=1)
    assert len(set(codes)) == 3 and all(len(c) == 4 and c.isdigit() for c in codes)
    assert codes == tasks.passcodes(3, seed=1)


@pytest.mark.real_model
def test_niah_builder_real_tokenizer_chat_template():
    from veloxquant_mlx.model import load_model

    _, tok = load_model()
    p = tasks.build_niah_prompt(tok, 512, 0.5, "7311")
    assert len(p.context_ids) == 512
    ctx, q = tok.decode(p.context_ids), tok.decode(p.question_ids)
    assert ctx.startswith("<|im_start|>") and "blue vault is 7311." in ctx
    assert q.startswith("\n\nQuestion:") and q.endswith("<|im_start|>assistant\n") and "7311" not in q
    assert 0.45 < p.needle_depth < 0.6


# --------------------------------------------------------------------------- --set rules


def test_resolve_methods_distributes_sets():
    specs = resolve_methods(["kivi", "snapkv"], ["bit_width_inlier=4", "snap_budget=64", "snapkv:obs_window=8"])
    assert [s.method for s in specs] == ["none", "kivi", "snapkv"]
    assert specs[0].settings == {}
    assert specs[1].settings == {"bit_width_inlier": 4}
    assert specs[2].settings == {"snap_budget": 64, "snap_obs_window": 8}  # snapkv reads no bit_width_inlier
    assert specs[2].config().snap_budget == 64
    specs = resolve_methods(["snapkv", "h2o", "kivi"], ["budget=64"], include_none=False)  # option names
    assert [s.settings for s in specs] == [{"snap_budget": 64}, {"h2o_budget": 64}, {}]
    with pytest.raises(cli.UsageError, match="method 'kivi' has no setting 'budget'"):
        resolve_methods(["kivi"], ["kivi:budget=64"])
    with pytest.raises(cli.UsageError, match="applies to none"):
        resolve_methods(["kivi"], ["snap_budget=64"])
    with pytest.raises(cli.UsageError, match="not one of the methods"):
        resolve_methods(["kivi"], ["snapkv:budget=64"])
    with pytest.raises(cli.UsageError, match="unknown method"):
        resolve_methods(["nope"])
    with pytest.raises(cli.UsageError, match="standalone"):
        resolve_methods(["qjl"])
    assert "qjl" not in implemented_mlx_lm_methods() and "kivi" in implemented_mlx_lm_methods()


def test_parser_constants_match():
    assert cli_measure.TASK_NAMES == tasks.TASKS
    assert cli_measure.SHAPE_NAMES == tuple(bench.SHAPES)


# --------------------------------------------------------------------------- ratios, slopes, stats


def _row(method, context, **medians):
    r = bench._bench_row(method, {}, method, context, 4, None)
    for k, v in medians.items():
        r[k] = {"median": v, "min": v, "max": v}
    return r


def test_ratio_arithmetic():
    rows = [_row("none", 100, prefill_s=2.0, decode_tps=10.0, kv_resident_bytes=1000, step_s=0.1),
            _row("mlx_q4", 100, prefill_s=4.0, decode_tps=20.0, kv_resident_bytes=250, step_s=0.05),
            _row("kivi", 100, prefill_s=1.0, decode_tps=5.0, kv_resident_bytes=500, step_s=0.2)]
    bench.add_ratios(rows)
    k = rows[2]["ratios"]
    assert k["none"]["prefill_s"] == 0.5 and k["none"]["decode_tps"] == 0.5 and k["none"]["kv_resident_bytes"] == 0.5
    assert k["mlx_q4"]["prefill_s"] == 0.25 and k["mlx_q4"]["kv_resident_bytes"] == 2.0
    assert k["mlx_q8"] is None  # not measured
    assert k["none"]["peak_bytes"] is None  # not measured either
    assert bench.stats([3, 1, 2, None]) == {"median": 2, "min": 1, "max": 3}
    assert bench.stats([None]) is None


def test_ratio_spread_adds_both_medians_spreads():
    rows = [_row("none", 100, decode_tps=10.0), _row("kivi", 100, decode_tps=5.0)]
    rows[0]["decode_tps"].update(min=9.0, max=11.0)  # +-10%
    rows[1]["decode_tps"].update(min=4.0, max=5.5)  # +-15%
    for r in rows:
        r["repeats"] = 2
    bench.add_ratios(rows)
    assert rows[1]["ratios"]["none"]["decode_tps"] == 0.5
    assert rows[1]["ratio_spread"]["none"]["decode_tps"] == pytest.approx(0.25)
    assert rows[1]["ratio_spread"]["none"]["prefill_s"] is None and rows[1]["ratio_spread"]["mlx_q4"] is None
    table = cli_measure.bench_tables(rows)
    assert "0.50 ±25%" in table


def test_slope_fit():
    assert bench.fit_slope([0, 1000, 2000], [1.0, 3.0, 5.0]) == pytest.approx(0.002)
    assert bench.fit_slope([5, 5], [1, 2]) is None
    rows = []
    for n in (1000, 3000):
        rows.append(_row("none", n, step_s=0.01 + 1e-6 * n))
        rows.append(_row("kivi", n, step_s=0.01 + 4e-6 * n))
    bench.add_slopes(rows)
    assert rows[0]["decode_s_per_1k"] == pytest.approx(1e-3)
    assert rows[1]["decode_s_per_1k"] == pytest.approx(4e-3) and rows[1]["slope_vs_none"] == pytest.approx(4.0)


# --------------------------------------------------------------------------- memory


def test_steady_rate_is_one_over_the_median_step(monkeypatch):
    """One slow step (a buffer's growth) weighs on decode_tps by its share of the run, not on steady_tps."""
    model = tiny_llama(seed=0, head_dim=16, n_layers=1)
    steps = [0.5, 0.1, 0.1, 0.1]
    monkeypatch.setattr(bench, "pipelined_decode", lambda step, tok, n: ([tok] * n, steps[:n]))
    r = bench.run_once(model, make_prompt_cache(model), mx.arange(1, 9).astype(mx.int32), decode_tokens=4)
    assert r["decode_tps"] == pytest.approx(4 / 0.8) and r["steady_tps"] == pytest.approx(10.0)
    assert r["step_s"] == pytest.approx(0.1) and r["first_step_s"] == 0.5
    rows = [_row("none", 100, decode_tps=20.0, steady_tps=100.0), _row("kivi", 100, decode_tps=30.0, steady_tps=80.0)]
    bench.add_ratios(rows)
    assert rows[1]["ratios"]["none"]["decode_tps"] == 1.5 and rows[1]["ratios"]["none"]["steady_tps"] == 0.8
    table = cli_measure.bench_tables(rows)
    assert "steady" in table and "1.50" in table and "0.80" in table


def test_resident_memory_of_a_known_cache():
    model = tiny_llama(seed=0, head_dim=16, n_layers=3)  # float32, 2 KV heads
    prompt = mx.arange(1, 41).astype(mx.int32)
    bench.run_once(model, make_prompt_cache(model), prompt[:8], decode_tokens=1)  # warm-up (first-call constants)
    r = bench.run_once(model, make_prompt_cache(model), prompt, decode_tokens=3)
    # 43 tokens -> mlx_lm's KVCache holds one 256-row step: 3 layers * (K, V) * 2 heads * 256 * 16 * 4 bytes
    expected = 3 * 2 * 2 * 256 * 16 * 4
    assert r["kv_nbytes"] == expected
    assert r["kv_resident_bytes"] == expected
    assert r["peak_delta_bytes"] >= expected and r["peak_bytes"] >= r["peak_delta_bytes"]
    assert r["prefill_s"] > 0 and r["decode_tps"] > 0

    # a cache that counts only its used rows: resident memory still sees the whole 256-row buffer
    class UsedRowsOnly(KVCache):
        @property
        def nbytes(self):
            return 2 * self.keys[..., : self.offset, :].nbytes

    r2 = bench.run_once(model, [UsedRowsOnly() for _ in range(3)], prompt, decode_tokens=3)
    assert r2["kv_nbytes"] == 3 * 2 * 2 * 43 * 16 * 4
    assert r2["kv_resident_bytes"] == expected


# MLX 0.32.4's CUDA backend has no quantized_matmul for some shapes (the tiny models' head dim 32 among them), so
# mlx_lm's own QuantizedKVCache cannot run there: the bench reports those baselines unavailable with MLX's error.
MLX_QMM_GAP = "No implementation for problem shape"


def _mlx_qmm_gap(error) -> bool:
    return mx.default_device().type == mx.DeviceType.gpu and MLX_QMM_GAP in str(error or "")


def test_quantized_baseline_cache_measured():
    model = tiny_llama(seed=0, head_dim=32, n_layers=2)
    caches = bench._mlx_quant_factory(8)(model)
    assert all(isinstance(c, QuantizedKVCache) and c.group_size == 32 and c.bits == 8 for c in caches)
    try:
        r = bench.run_once(model, caches, mx.arange(1, 41).astype(mx.int32), decode_tokens=2)
    except RuntimeError as exc:
        if not _mlx_qmm_gap(exc):
            raise
        pytest.skip(f"MLX's own quantized cache cannot run on this backend: {exc}")
    assert r["kv_nbytes"] > 0 and r["kv_resident_bytes"] >= r["kv_nbytes"]


# --------------------------------------------------------------------------- bench end to end


def test_bench_cli_tiny_shape_json(capsys):
    code, out, err = run_cli(capsys, "bench", "--shape", "tiny", "--random-weights", "--method", "kivi",
                             "--context", "16,48", "--repeats", "2", "--decode-tokens", "2", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["method"], r["context"]) for r in rows] == [
        (m, n) for m in ("none", "mlx_q4", "mlx_q8", "kivi") for n in (16, 48)]
    for r in rows:
        if r["method"].startswith("mlx_q") and _mlx_qmm_gap(r["error"]):
            assert not r["available"]  # reported with MLX's reason, the other rows unaffected
            continue
        assert r["available"] and r["repeats"] == 2 and r["error"] is None
        for k in bench.STATS:
            assert set(r[k]) == {"median", "min", "max"} and r[k]["min"] <= r[k]["median"] <= r[k]["max"]
        assert set(r["ratios"]) == set(bench.BASELINES)
        assert r["decode_s_per_1k"] is not None
        for k in bench.SAMPLED:  # each repeat's value, in run order: their median is the row's
            assert len(r["samples"][k]) == 2 and sorted(r["samples"][k]) == [r[k]["min"], r[k]["max"]]
    kivi = rows[-1]
    assert kivi["ratios"]["none"]["kv_nbytes"] == pytest.approx(
        kivi["kv_nbytes"]["median"] / rows[1]["kv_nbytes"]["median"])
    assert rows[0]["ratios"]["none"]["prefill_s"] == 1.0
    assert err == ""  # --json: no progress
    assert kivi["kv_fraction_of_fp16"] == pytest.approx(kivi["kv_nbytes"]["median"] / kivi["kv_bytes_fp16"])
    # tiny shape: 2 layers, 2 KV heads, head_dim 32; 48 prompt + 2 decoded tokens at fp16
    assert kivi["kv_bytes_fp16"] == 2 * 2 * 2 * 32 * 2 * (48 + 2)
    table = cli_measure.bench_tables(rows)
    assert "±" in table and max(len(line) for line in table.splitlines()) <= 125


def test_bench_cli_table_and_usage(capsys):
    code, out, err = run_cli(capsys, "bench", "--shape", "tiny", "--random-weights", "--baselines", "none",
                             "--method", "streaming_llm", "--set", "stream_window_size=8", "--context", "24",
                             "--prefill-step", "8", "--repeats", "1", "--decode-tokens", "2")
    assert code == 0
    assert "repeat 1/1, context 24: streaming_llm" in err
    assert "prefill 8/23 tokens" in err and "prefill 23/23 tokens" in err  # chunk progress inside each run
    assert "streaming_llm window_size=8" in out and "KV resident" in out and "kv_fraction_of_fp16" in out
    assert "±" not in out and "[" not in out  # one repeat: no spread
    assert max(len(line) for line in out.splitlines() if "|" not in line) <= 125
    assert run_cli(capsys, "bench", "--shape", "tiny", "--baselines", "mlx_q2")[0] == 2
    assert run_cli(capsys, "bench", "--random-weights")[0] == 2
    assert run_cli(capsys, "bench", "--shape", "tiny", "--method", "kivi", "--set", "snap_budget=3")[0] == 2


def test_bench_batch_decodes_sequences_together_through_batch_forms(capsys):
    """``--batch 3``: three sequences per run through merged batch caches (waterfill's batch form, mlx_lm's
    BatchKVCache for the plain cache; the quantized mlx_lm baselines have none, so only ``none`` is the
    default baseline); the rows, ratios and spreads come from the same run."""
    from mlx_lm.models.cache import BatchKVCache

    from veloxquant_mlx.cache.methods.quantization.waterfill_batch import WaterfillBatchKVCache

    wf = "waterfill bit_width_inlier=4 residual_length=16"
    code, out, err = run_cli(capsys, "bench", "--shape", "tiny", "--random-weights", "--method", wf,
                             "--context", "80", "--repeats", "2", "--decode-tokens", "3", "--batch", "3", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["method"] for r in rows] == ["none", "waterfill"]
    none, w = rows
    for r in rows:
        assert r["available"] and r["batch"] == 3 and r["repeats"] == 2
        assert r["kv_bytes_fp16"] == 3 * 2 * 2 * 2 * 32 * 2 * (80 + 3)  # 3 sequences, 2 layers, K+V, 2 heads
    for k in ("prefill_s", "decode_tps", "peak_delta_bytes"):
        assert w["ratios"]["none"][k] == pytest.approx(w[k]["median"] / none[k]["median"])
        assert w["ratio_spread"]["none"][k] == pytest.approx(
            bench._spread(w, k) + bench._spread(none, k))
    # compressed in the batch too (of 83 tokens, the 4 sinks and 16..31 window rows stay float16)
    assert w["kv_nbytes"]["median"] < 0.7 * w["kv_bytes_fp16"] < none["kv_nbytes"]["median"]
    # what a run does: one batch cache per layer, each sequence holding the prompt + the decoded tokens
    model = bench.random_model("tiny")
    cands = {c.name: c for c in bench.candidates([MethodSpec("waterfill", {"residual_length": 16})], ["none"])}
    for name, cls in (("none", BatchKVCache), ("waterfill", WaterfillBatchKVCache)):
        caches = bench.batch_caches(cands[name].make, model, 3)
        assert all(type(c) is cls for c in caches)
        r = bench.run_once(model, caches, bench._prompt(512, 80, 0, batch=3), decode_tokens=3)
        assert r["decode_tps"] > 0 and caches[0].offset.tolist() == [83] * 3
    for k in bench.SAMPLED:  # interleaved in this process: each repeat against the plain cache's same repeat
        per_repeat = [a / b for a, b in zip(w["samples"][k], none["samples"][k])]
        assert w["paired_ratios"]["none"][k] == bench.stats(per_repeat)
    text = cli_measure.bench_tables(rows)
    assert f"{w['ratios']['none']['decode_tps']:.2f} ±" in text
    p = w["paired_ratios"]["none"]["steady_tps"]
    assert "Per-repeat ratios" in text and f"{p['median']:.2f} [{p['min']:.2f}-{p['max']:.2f}]" in text


def test_paired_ratios_pair_repeats_only_of_interleaved_runs():
    """Per-repeat ratios: repeat i of the candidate over repeat i of the baseline (not the ratio of medians); none
    for rows whose runs were not interleaved in one process (``--isolate``) or whose repeat counts differ."""
    rows = [_row("none", 100, decode_tps=10.0), _row("kivi", 100, decode_tps=6.0)]
    rows[0]["samples"] = {"decode_tps": [10.0, 5.0, 12.0], "prefill_s": [1.0, 1.0, 1.0]}
    rows[1]["samples"] = {"decode_tps": [9.0, 4.0, 6.0], "prefill_s": [2.0, 1.5, None]}
    for r in rows:
        r["repeats"], r["interleaved"] = 3, True
    bench.add_ratios(rows)
    pr = rows[1]["paired_ratios"]["none"]
    assert pr["decode_tps"] == {"median": 0.8, "min": 0.5, "max": 0.9}  # the medians' ratio is 0.6
    assert pr["prefill_s"] == {"median": 1.75, "min": 1.5, "max": 2.0}  # a missing run drops its pair only
    assert rows[1]["ratios"]["none"]["decode_tps"] == 0.6 and rows[1]["paired_ratios"]["mlx_q4"] is None
    assert "0.80 [0.50-0.90]" in cli_measure.bench_tables(rows)
    rows[1]["samples"]["decode_tps"] = [9.0, 4.0]  # repeat counts differ: no pairing
    assert "decode_tps" not in bench.add_ratios(rows)[1]["paired_ratios"]["none"]
    rows[1]["interleaved"] = False  # e.g. a row from an --isolate child process
    assert bench.add_ratios(rows)[1]["paired_ratios"]["none"] is None
    assert "Per-repeat ratios" not in cli_measure.bench_tables(rows)


def test_bench_batch_refuses_caches_without_batch_form(capsys):
    code, _, err = run_cli(capsys, "bench", "--shape", "tiny", "--random-weights", "--method", "snapkv",
                           "--batch", "2")
    assert code == 2 and "--batch 2: snapkv has no batch form" in err and "waterfill" in err and "kivi" in err
    code, _, err = run_cli(capsys, "bench", "--shape", "tiny", "--random-weights", "--baselines", "none,mlx_q4",
                           "--batch", "2")
    assert code == 2 and "mlx_q4 has no batch form" in err
    assert run_cli(capsys, "bench", "--shape", "tiny", "--batch", "0")[0] == 2
    with pytest.raises(ValueError, match="no batch form for snapkv"):
        bench.bench(bench.random_model("tiny"), ["snapkv"], contexts=[16], baselines=["none"], batch=2)
    assert bench.has_batch_form("none") and not bench.has_batch_form("mlx_q8")
    assert {"kivi", "turboquant_rvq", "streaming_llm", "waterfill"} <= set(bench.batch_methods())
    assert "snapkv" not in bench.batch_methods()


def test_bench_failing_baseline_reported_unavailable(monkeypatch):
    gap = ('[quantized_matmul] No implementation for problem shape: 15x15x32x4, transpose: true, activation: '
           'float16, bits: 8, group size: 32, mode: "affine".')  # MLX 0.32.4's CUDA backend, word for word

    def boom(self, *a, **k):
        raise RuntimeError(gap)

    monkeypatch.setattr(QuantizedKVCache, "update_and_fetch", boom)
    model = bench.random_model("tiny")
    rows = bench.bench(model, ["streaming_llm"], contexts=[16], repeats=1, decode_tokens=1)
    by = {r["method"]: r for r in rows}
    assert by["none"]["available"] and by["streaming_llm"]["available"]
    for b in ("mlx_q4", "mlx_q8"):
        assert not by[b]["available"] and "No implementation" in by[b]["error"]
    assert by["streaming_llm"]["ratios"]["mlx_q4"] is None and by["streaming_llm"]["ratios"]["none"] is not None
    report = cli_measure.bench_tables(rows)  # the reason, whole, in lines no wider than the tables
    assert max(len(line) for line in report.splitlines()) <= 125
    assert " ".join(report.split()).count(f": {gap}") == 2  # mlx_q4 and mlx_q8, each whole


def test_bench_warmup_modes(monkeypatch):
    """``warmup``: "full" runs every candidate once per context before the timed repeats, "short" once at 256
    tokens at most, "none" never; anything else is refused naming the allowed values."""
    seen = []
    real = bench.run_once
    monkeypatch.setattr(bench, "run_once", lambda model, caches, prompt, *a, **k: (
        seen.append(prompt.shape[-1]), real(model, caches, prompt, *a, **k))[1])
    model = bench.random_model("tiny")
    timed = [16, 16, 40, 40]  # per context, each of the two candidates
    for mode, warm in (("full", [16, 16, 40, 40]), ("short", [16, 16]), ("none", [])):
        seen.clear()
        bench.bench(model, ["streaming_llm"], contexts=[16, 40], repeats=1, decode_tokens=1, baselines=["none"],
                    warmup=mode)
        assert seen == warm + timed, mode
    with pytest.raises(ValueError, match="warmup='long'; allowed"):
        bench.bench(model, [], contexts=[16], warmup="long")


@pytest.mark.parametrize("flags,mode", [([], "short"), (["--warmup", "full"], "full"), (["--no-warmup"], "none")])
def test_isolated_children_get_the_warmup_mode(flags, mode):
    from veloxquant_mlx import cli, cli_measure

    args = cli._parser().parse_args(["bench", "--shape", "tiny", "--random-weights", "--context", "16", *flags])
    args.contexts = args.context  # as cmd_bench sets it
    argv = cli_measure._child_args(args)("none", None)
    assert argv[argv.index("--warmup") + 1] == mode and "--no-warmup" not in argv


def test_bench_isolated_subprocess_failure_is_contained():
    shared = ["--shape", "tiny", "--random-weights", "--context", "16", "--repeats", "1", "--decode-tokens", "1",
              "--no-warmup"]

    def child_args(baseline, spec):
        if baseline is not None:
            return shared + ["--baselines", baseline]
        return ["--shape", "no-such-shape"]  # this child fails

    rows = bench.bench_isolated(child_args, [MethodSpec("kivi")], [16], 1, baselines=["none"], timeout_s=120)
    by = {r["method"]: r for r in rows}
    assert by["none"]["available"] and by["none"]["prefill_s"]["median"] > 0
    assert not by["none"]["interleaved"]  # its child process ran apart from the others: no per-repeat pairing
    assert not by["kivi"]["available"] and "exit code 2" in by["kivi"]["error"]


def test_random_model_shapes():
    m = bench.random_model("tiny", dtype="float16")
    assert m.model.embed_tokens.weight.dtype == mx.float16
    assert len(m.model.layers) == bench.SHAPES["tiny"]["num_hidden_layers"]
    assert bench.SHAPES["llama-8b"]["head_dim"] == 128 and bench.SHAPES["llama-1b"]["num_key_value_heads"] == 8


# --------------------------------------------------------------------------- eval CLI, plot, results.md


def test_eval_cli_on_tiny_text_file(tmp_path, capsys, monkeypatch, tiny):
    import veloxquant_mlx.model as model_mod

    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: tiny)
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "eval", "--method", "streaming_llm", "--set", "stream_window_size=16",
                             "--text-file", str(text_file), "--context", "160", "--n-score", "4",
                             "--depths", "0.5", "--json", "--out", str(out_dir))
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["method"], r["task"]) for r in rows] == [
        (m, t) for t in ("ppl", "kld", "niah") for m in ("none", "streaming_llm")]
    assert all(tuple(r) == tasks.ROW_KEYS for r in rows)
    assert "loading model" not in err  # --json: no progress
    md = (out_dir / "results.md").read_text()
    assert "| streaming_llm | stream_window_size=16 | kld | 160 |" in md
    assert json.loads((out_dir / "results.json").read_text()) == rows
    # the table
    code, out, err = run_cli(capsys, "eval", "--method", "kivi", "--task", "kld", "--text-file", str(text_file),
                             "--context", "64", "--n-score", "2")
    assert code == 0 and "kivi" in out and "KLD" in out and "kv_fraction_of_fp16" in out
    assert "1/4 loading model" in err and "4/4 kld: kivi" in err and "prefill 63/63 tokens" in err
    # usage errors
    assert run_cli(capsys, "eval", "--task", "kld")[0] == 2  # no method
    assert run_cli(capsys, "eval", "--method", "kivi", "--text-file", str(tmp_path / "missing.txt"))[0] == 2
    assert run_cli(capsys, "eval", "--method", "kivi", "--task", "kld", "--text-file", str(text_file),
                   "--context", "5000")[0] == 2  # text too short


@pytest.mark.real_model
def test_eval_cli_real_model_kld(tmp_path, capsys):
    from veloxquant_mlx.assets import essays_text

    text_file = tmp_path / "essay.txt"
    text_file.write_text(essays_text(max_chars=2000))
    code, out, err = run_cli(capsys, "eval", "--method", "streaming_llm", "--set", "stream_window_size=24",
                             "--task", "kld", "--text-file", str(text_file), "--context", "64", "--n-score", "4",
                             "--json")
    assert code == 0, err
    none, stream = json.loads(out)
    assert none["kld"] < 1e-4 and none["top1_agree"] == 1.0
    assert stream["kld"] > none["kld"] and stream["kv_fraction_of_fp16"] < none["kv_fraction_of_fp16"]


F = "kv_fraction_of_fp16"
PARETO_PTS = [{"label": "a", "method": "a", F: 1.0, "kld": 0.0},
              {"label": "b", "method": "b", F: 0.25, "kld": 0.1},
              {"label": "c", "method": "c", F: 0.33, "kld": 0.2},  # dominated by b
              {"label": "d", "method": "d", F: 0.5, "kld": 0.01}]
PARETO_ROWS = [{"task": "kld", **p} for p in PARETO_PTS]


def test_pareto_front():
    assert [p["label"] for p in plot.pareto_front(PARETO_PTS)] == ["b", "d", "a"]
    assert plot.pareto_points(PARETO_ROWS) == PARETO_PTS
    assert plot.plot_pareto([{"task": "niah", "kld": None}], "unused.png") is False  # nothing to draw


def test_plot_pareto_writes_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert plot.plot_pareto(PARETO_ROWS, out) is True
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (800, 500)  # figsize 8x5 inches at 100 dpi
    md_dir = tmp_path / "out"
    cli_measure.write_eval_outputs(_full_rows(), md_dir, {"model": "m"}, note=lambda m: None)
    assert (md_dir / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![kv_fraction_of_fp16 vs KLD](pareto.png)" in (md_dir / "results.md").read_text()


def _full_rows():
    return [{**dict.fromkeys(tasks.ROW_KEYS), "settings": {}, "context": 64, **r} for r in PARETO_ROWS]


def test_eval_outputs_without_matplotlib_say_which_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    notes = []
    cli_measure.write_eval_outputs(_full_rows(), tmp_path, {"model": "m"}, note=notes.append)
    assert notes[0] == "no pareto.png: " + plot.PLOT_EXTRA_HINT and "veloxquant-mlx[plot]" in notes[0]
    assert not (tmp_path / "pareto.png").exists()
    md = (tmp_path / "results.md").read_text()
    assert "| a | defaults | kld | 64 |" in md and "pareto.png" not in md
    assert "Pareto front" in md  # the front is still listed in words


# --------------------------------------------------------------------------- the retired quality scripts


def test_eval_flags_reproduce_the_retired_quality_scripts(tmp_path, capsys, monkeypatch, tiny):
    """One ``eval`` run with several configurations of a method, a budget sweep and two contexts gives the
    numbers the retired scripts computed with ``next_token_fidelity`` on a hand-built config (same config ->
    same KLD and bytes): the scoring script (h2o budgets and its paper-like variant), the quantizer script
    (skvq options), the query-aware script (KVzip with its reconstruction pass); ``git show bf46cf3:scripts``."""
    import veloxquant_mlx.model as model_mod
    from veloxquant_mlx.cache import KVCacheConfig
    from veloxquant_mlx.cache.methods.kvzip import KVzipKVCache
    from veloxquant_mlx.cache.options import H2OOptions, KVzipOptions, SKVQOptions
    from veloxquant_mlx.eval.fidelity import next_token_fidelity, reference_logprobs

    model, tok = tiny
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: tiny)
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    code, out, err = run_cli(capsys, "eval", "--method", "h2o", "--method", "h2o decay=1.0 grace=16",
                             "--method", "skvq window=32 reorder=false", "--sweep", "h2o:budget=32,48",
                             "--task", "kld", "--context", "96,128", "--n-score", "6",
                             "--text-file", str(text_file), "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["context"], r["label"]) for r in rows] == [(c, lab) for c in (96, 128) for lab in (
        "none", "h2o h2o_budget=32", "h2o h2o_budget=48", "h2o h2o_decay=1.0 h2o_grace=16 h2o_budget=32",
        "h2o h2o_decay=1.0 h2o_grace=16 h2o_budget=48", "skvq skvq_window=32 skvq_reorder=False")]
    by = {(r["context"], r["label"]): r for r in rows}
    configs = {  # the retired scripts' own configurations
        "h2o h2o_budget=32": KVCacheConfig(method="h2o", options=H2OOptions(budget=32)),
        "h2o h2o_decay=1.0 h2o_grace=16 h2o_budget=48": KVCacheConfig(
            method="h2o", options=H2OOptions(budget=48, decay=1.0, grace=16)),
        "skvq skvq_window=32 skvq_reorder=False": KVCacheConfig(
            method="skvq", options=SKVQOptions(window=32, reorder=False)),
    }
    for context in (96, 128):
        ids = tasks.text_tokens(tok, context + 6, TEXT)
        ref = reference_logprobs(model, ids, context, 6)
        for label, cfg in configs.items():
            r = next_token_fidelity(model, ids, context, 6, cfg, ref_logp=ref)
            row = by[(context, label)]
            assert row["kld"] == pytest.approx(r.kld, rel=1e-6, abs=1e-9), (context, label)
            assert (row["top1_agree"], row["kv_bytes"]) == (r.top1_agree, r.kv_bytes), (context, label)
    assert by[(96, "h2o h2o_budget=32")]["kv_bytes"] < by[(96, "h2o h2o_budget=48")]["kv_bytes"]

    # --reconstruct: KVzip's compress_with_model between the prefill and the scored steps, as the script did
    code, out, err = run_cli(capsys, "eval", "--method", "kvzip budget=32", "--reconstruct", "--task", "kld",
                             "--context", "96", "--n-score", "6", "--text-file", str(text_file), "--json")
    assert code == 0, err
    row = json.loads(out)[1]
    ids = tasks.text_tokens(tok, 102, TEXT)
    cfg = KVCacheConfig(method="kvzip", options=KVzipOptions(budget=32))
    with_pass = next_token_fidelity(model, ids, 96, 6, cfg, after_prefill=lambda caches, ctx: (
        KVzipKVCache.compress_with_model(model, caches, ctx, tokenizer=tok)))
    without = next_token_fidelity(model, ids, 96, 6, cfg)
    assert row["kld"] == pytest.approx(with_pass.kld, rel=1e-6, abs=1e-9) and row["kv_bytes"] == with_pass.kv_bytes
    assert abs(row["kld"] - without.kld) > 1e-4  # the pass ran: other rows kept than without it


def test_method_settings_and_sweeps_resolve():
    specs = resolve_methods(["snapkv budget=64", "snapkv budget=96 obs_window=8", "kivi"], ["bit_width_inlier=2"],
                            sweeps=["kivi:bit_width_inlier=2,4"])
    assert [(s.method, s.settings) for s in specs] == [
        ("none", {}), ("snapkv", {"snap_budget": 64}), ("snapkv", {"snap_budget": 96, "snap_obs_window": 8}),
        ("kivi", {"bit_width_inlier": 2}), ("kivi", {"bit_width_inlier": 4})]
    specs = resolve_methods(["h2o", "tova"], sweeps=["budget=16,32"], include_none=False)
    assert [s.label for s in specs] == ["h2o h2o_budget=16", "h2o h2o_budget=32",
                                        "tova tova_budget=16", "tova tova_budget=32"]
    assert specs[1].config().options.budget == 32
    with pytest.raises(cli.UsageError, match="--sweep bit_width_inlier=2,4: 'bit_width_inlier' applies to none"):
        resolve_methods(["h2o"], sweeps=["bit_width_inlier=2,4"])
    with pytest.raises(cli.UsageError, match="takes no settings"):
        resolve_methods(["none window=3"])
    with pytest.raises(cli.UsageError, match="method 'kivi' has no setting 'budget'"):
        resolve_methods(["kivi budget=3"])


def test_resolve_methods_refuses_one_setting_given_two_values(capsys):
    """--set (scoped or not, option name or flat alias) and a method string refuse two values of one setting,
    as ``settings.parse_sets`` does; the same value twice passes."""
    for sets in (["waterfill:bit_width_inlier=4", "waterfill:bit_width_inlier=8"],
                 ["bit_width_inlier=4", "bit_width_inlier=8"], ["bit_width_inlier=4", "waterfill:bit_width_inlier=8"]):
        with pytest.raises(cli.UsageError, match=r"'bit_width_inlier' is set twice \(4 and 8\)"):
            resolve_methods(["waterfill"], sets)
    with pytest.raises(cli.UsageError, match=r"'bit_width_inlier' is set twice \(4 and 8\)"):
        resolve_methods(["waterfill bit_width_inlier=4 bit_width_inlier=8"])
    with pytest.raises(cli.UsageError, match=r"'snap_budget' is set twice \(64 and 128\)"):
        resolve_methods(["snapkv", "h2o"], ["budget=64", "snapkv:snap_budget=128"])
    with pytest.raises(cli.UsageError, match=r"'residual_length' is set twice \(16 and 32\)"):  # the quantizer's
        resolve_methods(["snapkv quantize=waterfill residual_length=16 waterfill:residual_length=32"])
    specs = resolve_methods(["waterfill"], ["bit_width_inlier=4", "waterfill:bit_width_inlier=4"], include_none=False)
    assert [s.settings for s in specs] == [{"bit_width_inlier": 4}]
    specs = resolve_methods(["snapkv"], ["snapkv:quantize=kivi", "snapkv:group_size=16"], include_none=False)
    assert specs[0].config().options.quantize.group_size == 16  # the quantizer's name, --set beside quantize=
    code, _, err = run_cli(capsys, "eval", "--method", "kivi", "--set", "kivi:bit_width_inlier=2", "--set",
                           "kivi:bit_width_inlier=4", "--task", "kld")  # before any model loads
    assert code == 2 and "'bit_width_inlier' is set twice (2 and 4)" in err


def test_sweeps_of_one_setting_twice_are_refused():
    with pytest.raises(cli.UsageError, match=r"--sweep h2o:budget=64: 'h2o_budget' of h2o is swept twice"):
        resolve_methods(["h2o"], sweeps=["budget=16,32", "h2o:budget=64"])
    with pytest.raises(cli.UsageError, match="swept twice"):
        resolve_methods(["h2o"], sweeps=["budget=16", "h2o_budget=32"])
    specs = resolve_methods(["h2o", "kivi"], sweeps=["budget=16,32", "kivi:bit_width_inlier=2,4"], include_none=False)
    assert len(specs) == 4


@pytest.mark.parametrize("method", ["none", "kivi"])
def test_bench_pipelined_decode_generates_what_mlx_lm_generates(method):
    """``run_once`` pipelines decode steps as mlx_lm's ``generate_step`` does (step i + 1 built while step i
    evaluates): the greedy tokens are the ones mlx_lm's own loop produces with a fresh cache, and every step
    is timed."""
    from tiny_models import greedy

    from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig

    model = bench.random_model("tiny")

    def caches():
        return (make_prompt_cache(model) if method == "none"
                else KVCacheBuilder.for_model(model, KVCacheConfig(method=method, bit_width_inlier=4)))

    prompt = mx.random.randint(0, 500, (40,), key=mx.random.key(3))
    out = bench.run_once(model, caches(), prompt, 6, prefill_step=16)
    want = greedy(model, prompt.tolist(), caches(), max_tokens=7, prefill_step_size=16)
    assert out["tokens"] == [want]
    assert out["decode_tps"] > 0 and out["step_s"] > 0
