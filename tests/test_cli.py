"""The ``veloxquant`` command line (``veloxquant_mlx.cli``) and byte accounting (``veloxquant_mlx.measure``).

The CLI runs in-process through ``cli.main([...])`` (which returns the exit code); one test runs
``python -m veloxquant_mlx`` in a subprocess. Tests marked ``real_model`` run the embedded
SmolLM2-135M-Instruct model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from veloxquant_mlx import cli  # noqa: I001  (imports veloxquant_mlx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from veloxquant_mlx import measure  # noqa: E402
from veloxquant_mlx.cache import settings  # noqa: E402
from veloxquant_mlx.cache import (  # noqa: E402
    METHOD_NAMES,
    KVCacheConfig,
    KVCacheFactory,
    QuantizerConfigError,
    SnapKVOptions,
    all_methods,
    method_info,
)

REPO = Path(__file__).resolve().parents[1]
METHOD_KEYS = {"name", "family", "protocol", "implemented", "paper"}
GENERATE_KEYS = {"method", "settings", "model", "text", "prompt_tokens", "generated_tokens", "prefill_s",
                 "decode_tps", "kv_tokens", "kv_bytes", "kv_bytes_fp16", "kv_fraction_of_fp16"}


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- methods


def test_methods_json_matches_registry(capsys):
    code, out, _ = run_cli(capsys, "methods", "--json")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 44 == len(METHOD_NAMES)  # the spec's 43 + waterfill
    assert [r["name"] for r in rows] == list(METHOD_NAMES)
    for row in rows:
        assert set(row) == METHOD_KEYS
        info = method_info(row["name"])
        assert row["implemented"] is info.implemented
        assert (row["family"], row["protocol"], row["paper"]) == (info.family, info.protocol, info.paper)


def test_methods_table_lists_every_method(capsys):
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0
    lines = out.splitlines()
    for info in all_methods():
        row = next(line for line in lines if line.split()[:1] == [info.name])
        assert ("yes" if info.implemented else "no") in row.split()
    built = sum(i.implemented for i in all_methods())
    assert f"{built} of 44 methods implemented" in out


def test_python_dash_m_methods_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "methods"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "turboquant_rvq" in proc.stdout and "age_tiered" in proc.stdout
    assert "of 44 methods implemented" in proc.stdout


def test_no_command_and_help_exit_codes(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert cli.main(["generate", "--method", "snapkv"]) == 2  # --prompt is required
    capsys.readouterr()


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--method", "kivi", "--distances", "100"], "--distances applies only with --task recall"),
    (["eval", "--method", "kivi", "--task", "ppl", "--depths", "0.5"], "--depths applies only with --task niah"),
    (["eval", "--method", "kivi", "--task", "recall", "--distances", "10", "--depths", "0.5"],
     "--depths applies only with --task niah"),
    (["bench", "--method", "kivi", "--timeout", "5"], "--timeout applies only with --isolate"),
])
def test_a_flag_that_would_be_ignored_exits_2(capsys, monkeypatch, argv, needle):
    import veloxquant_mlx.model as model_mod

    def no_model(*a, **k):
        raise AssertionError("refused before a model loads")
    monkeypatch.setattr(model_mod, "load_model", no_model)
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and needle in err, err


# --------------------------------------------------------------------------- --set parsing


@pytest.mark.parametrize(
    "item, expected",
    [
        ("snap_budget=64", ("snap_budget", 64)),
        ("svdq_energy_threshold=0.9", ("svdq_energy_threshold", 0.9)),
        ("cam_merge_keys=true", ("cam_merge_keys", True)),
        ("cam_merge_keys=False", ("cam_merge_keys", False)),
        ("bit_width_inlier=[4, 2, 2]", ("bit_width_inlier", [4, 2, 2])),
        ("palu_rank=null", ("palu_rank", None)),
        ("palu_rank=None", ("palu_rank", None)),
        ("knorm_keep=high", ("knorm_keep", "high")),
        ("spectral_model_name=my model=v2", ("spectral_model_name", "my model=v2")),
        ("spectral_model_name=\"42\"", ("spectral_model_name", "42")),
    ],
)
def test_parse_set_values(item, expected):
    assert cli.parse_set(item) == expected


@pytest.mark.parametrize("item", ["snap_budget", "=3", ""])
def test_parse_set_rejects_malformed(item):
    with pytest.raises(cli.UsageError):
        cli.parse_set(item)


def test_parse_sets_rejects_unknown_and_unsettable_fields():
    assert cli.parse_sets(["snap_budget=64", "snap_n_sink=2"]) == {"snap_budget": 64, "snap_n_sink": 2}
    with pytest.raises(cli.UsageError, match="snap_budgett"):
        cli.parse_sets(["snap_budgett=64"])
    with pytest.raises(cli.UsageError, match="--method"):
        cli.parse_sets(["method=kivi"])


def test_build_config_routes_method_fields_through_options():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the options path is not deprecated
        cfg = cli.build_config("snapkv", {"snap_budget": 64, "snap_n_sink": 2, "seed": 7})
    assert isinstance(cfg.options, SnapKVOptions)
    assert (cfg.snap_budget, cfg.snap_n_sink, cfg.seed, cfg.method) == (64, 2, 7, "snapkv")
    cfg = cli.build_config("kivi", {"bit_width_inlier": 4})
    assert cfg.bit_width_inlier == 4
    cfg = cli.build_config("snapkv", {"dtype": "float16"})
    assert cfg.dtype == mx.float16
    with pytest.raises(cli.UsageError, match="dtype"):
        cli.build_config("snapkv", {"dtype": "float17"})


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_each_method_accepts_its_own_settings_and_refuses_another_methods(method):
    from veloxquant_mlx.cache.options import method_fields

    names = method_fields(method)
    settable = {n: f for n, f in names.items() if f not in settings._NOT_SETTABLE}
    for name, flat in settable.items():
        assert list(cli.parse_sets([f"{name}=1"], method=method)) == [flat]
    foreign = next(f for m in METHOD_NAMES if m != method for f in method_fields(m).values()
                   if f not in names and f not in settings._NOT_SETTABLE)
    with pytest.raises(cli.UsageError) as exc:
        cli.parse_sets([f"{foreign}=1"], method=method)
    msg = str(exc.value)
    assert f"method {method!r} has no setting {foreign!r}" in msg and f"veloxquant methods {method}" in msg
    for name in list(settable)[:3]:
        assert name in msg


def test_option_names_and_flat_names_build_the_same_config():
    _, by_option = cli.method_config("snapkv", ["budget=256", "n_sink=2"])
    _, by_flat = cli.method_config("snapkv", ["snap_budget=256", "snap_n_sink=2"])
    assert by_option == by_flat and by_option.snap_budget == 256 and by_option.snap_n_sink == 2
    _, cfg = cli.method_config("nsnquant", ["seed=5", "bits=3"])  # nsnquant's own seed, not the shared one
    assert (cfg.nsn_seed, cfg.seed, cfg.nsn_bits) == (5, KVCacheConfig().seed, 3)
    _, cfg = cli.method_config("snapkv", ["dtype=bfloat16", "snap_dtype=float32"])
    assert (cfg.dtype, cfg.snap_dtype) == (mx.bfloat16, "float32")


@pytest.mark.parametrize("argv, method, field", [
    (["--method", "kivi", "--set", "snap_budget=256"], "kivi", "snap_budget"),
    (["--method", "streaming_llm", "--set", "bit_width_inlier=2"], "streaming_llm", "bit_width_inlier"),
    (["--method", "snapkv", "--set", "window_size=8"], "snapkv", "window_size"),
])
def test_generate_and_cache_save_refuse_another_methods_field(capsys, tmp_path, argv, method, field):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    for cmd in (["generate", "--prompt", "hi"], ["cache", "save", "--prompt-file", str(prompt), "--out",
                                                 str(tmp_path / "c")]):
        code, out, err = run_cli(capsys, *cmd, *argv)
        assert code == 2 and out == "" and f"method {method!r} has no setting {field!r}" in err


def test_methods_name_lists_settings_with_type_default_allowed_and_alias(capsys):
    code, out, _ = run_cli(capsys, "methods", "snapkv", "--json")
    assert code == 0
    info = json.loads(out)
    rows = {r["name"]: r for r in info["settings"]}
    assert info["method"] == "snapkv"
    assert rows["budget"] == {"name": "budget", "flat": "snap_budget", "kind": "option", "type": "int",
                              "default": 512, "allowed": "an int in 1..1048576"}
    assert rows["backend"]["allowed"] == "one of 'auto', 'mlx', 'metal', 'reference'"
    assert rows["snap_dtype"]["kind"] == "option" and rows["dtype"]["kind"] == "shared"
    assert [r["name"] for r in cli.method_settings("snapkv")] == list(rows)
    assert "snap_budget" not in rows and "bit_width_inlier" not in rows
    code, out, _ = run_cli(capsys, "methods", "snapkv")
    assert code == 0 and "budget" in out and "snap_budget" in out and "an int in 1..1048576" in out
    code, _, err = run_cli(capsys, "methods", "snapkvv")
    assert code == 2 and "snapkvv" in err


def test_methods_json_into_a_closed_pipe_ends_without_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for reader in ("head -n 2", "true"):  # `true` exits before the CLI writes: every write hits a closed pipe
        proc = subprocess.run(f"{sys.executable} -m veloxquant_mlx methods --json | {reader}", shell=True, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.splitlines()[:1] == (["["] if reader != "true" else [])
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_generate_unknown_field_exits_2_naming_it(capsys):
    code, out, err = run_cli(capsys, "generate", "--method", "snapkv", "--set", "snap_budgett=64",
                             "--prompt", "hi")
    assert code == 2
    assert "snap_budgett" in err and out == ""


def test_generate_bad_value_exits_2_with_config_error_text(capsys):
    with pytest.raises(QuantizerConfigError) as exc:
        KVCacheConfig(method="snapkv", options=SnapKVOptions(budget=-5))
    code, _, err = run_cli(capsys, "generate", "--method", "snapkv", "--set", "snap_budget=-5", "--prompt", "hi")
    assert code == 2
    assert str(exc.value) in err

    code, _, err = run_cli(capsys, "generate", "--method", "snapkv", "--set", "snap_backend=cuda",
                           "--prompt", "hi")
    assert code == 2 and "snap_backend='cuda' is invalid" in err


def test_generate_unknown_method_exits_2(capsys):
    code, _, err = run_cli(capsys, "generate", "--method", "kivy", "--prompt", "hi")
    assert code == 2 and "kivy" in err and "veloxquant methods" in err


def test_generate_unimplemented_method_exits_2_with_clear_message(capsys, monkeypatch):
    from veloxquant_mlx.cache import base

    monkeypatch.delitem(base._CLASSES, "tova")  # a registered mlx_lm method whose class is not built
    missing = [i.name for i in all_methods() if not i.implemented and i.protocol == "mlx_lm"]
    assert missing == ["tova"]
    code, out, err = run_cli(capsys, "generate", "--method", missing[0], "--prompt", "hi")
    assert code == 2 and out == ""
    assert missing[0] in err and "not implemented" in err


def test_generate_none_rejects_set(capsys):
    code, _, err = run_cli(capsys, "generate", "--method", "none", "--set", "snap_budget=64", "--prompt", "hi")
    assert code == 2 and "--set" in err


def test_demo_rejects_unknown_method(capsys):
    code, _, err = run_cli(capsys, "demo", "--methods", "snapkv,nope")
    assert code == 2 and "nope" in err


# --------------------------------------------------------------------------- measure


def _kv(B=1, H=2, T=5, D=8, seed=0):
    mx.random.seed(seed)
    return mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D))


def test_kv_bytes_is_the_sum_of_nbytes():
    plain = KVCache()
    plain.update_and_fetch(*_kv(T=5))
    snap = KVCacheFactory.create(KVCacheConfig(method="snapkv", head_dim=8))
    snap.update_and_fetch(*_kv(T=7, seed=1))
    empty = KVCache()
    caches = [plain, snap, empty]
    assert measure.kv_bytes(caches) == plain.nbytes + snap.nbytes + empty.nbytes
    assert measure.kv_bytes(caches) > 0
    assert measure.kv_bytes([]) == 0
    assert measure.cache_tokens(caches) == 7


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp16_kv_bytes_matches_the_plain_cache_shapes(arch):
    from tiny_models import ARCHS

    model = ARCHS[arch]()
    caches = make_prompt_cache(model)
    T = 37
    model(mx.arange(T)[None] % 100, cache=caches)
    expected = 0
    for c in caches:
        B, H, _, Dk = c.keys.shape
        Dv = c.values.shape[-1]
        expected += B * H * c.offset * (Dk + Dv) * 2
    assert measure.fp16_kv_bytes(model, T) == expected
    assert measure.fp16_kv_bytes(model, T, batch_size=3) == 3 * expected
    assert measure.fp16_kv_bytes(model, 0) == 0


def test_fp16_kv_bytes_caps_sliding_window_layers():
    from tiny_models import tiny_gemma3

    model = tiny_gemma3()  # 4 layers, sliding window 8 on every other layer, 2 KV heads, head_dim 16
    kinds = [type(c).__name__ for c in make_prompt_cache(model)]
    n_rot, n_full = kinds.count("RotatingKVCache"), kinds.count("KVCache")
    assert n_rot + n_full == 4 and n_rot > 0
    per_token_layer = 2 * 2 * 16 * 2
    assert measure.fp16_kv_bytes(model, 30) == per_token_layer * (n_full * 30 + n_rot * 8)
    assert measure.fp16_kv_bytes(model, 5) == per_token_layer * 4 * 5


# --------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def long_prompt():
    from veloxquant_mlx.assets import essays_text

    return essays_text(max_chars=1200) + "\n\nSummarize the text above in one sentence."


@pytest.mark.real_model
def test_generate_none_and_snapkv_json(capsys, long_prompt):
    code, out, err = run_cli(capsys, "generate", "--method", "none", "--prompt", long_prompt,
                             "--max-tokens", "4", "--json")
    assert code == 0, err
    plain = json.loads(out)
    assert set(plain) == GENERATE_KEYS
    assert plain["method"] == "none" and plain["prompt_tokens"] > 200
    assert 1 <= plain["generated_tokens"] <= 4
    assert plain["prompt_tokens"] <= plain["kv_tokens"] <= plain["prompt_tokens"] + plain["generated_tokens"]
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; K and V at 2 bytes per element
    assert plain["kv_bytes_fp16"] == 30 * 2 * 3 * 64 * 2 * plain["kv_tokens"]
    assert plain["kv_bytes"] >= plain["kv_bytes_fp16"]  # full precision (or fp16) plus mlx_lm's slack
    assert plain["kv_fraction_of_fp16"] == pytest.approx(plain["kv_bytes"] / plain["kv_bytes_fp16"])

    code, out, err = run_cli(capsys, "generate", "--method", "snapkv", "--set", "snap_budget=64",
                             "--prompt", long_prompt, "--max-tokens", "4", "--json")
    assert code == 0, err
    snap = json.loads(out)
    assert set(snap) == GENERATE_KEYS
    assert snap["settings"] == {"snap_budget": 64}
    assert snap["prompt_tokens"] == plain["prompt_tokens"] > 64
    assert snap["kv_bytes"] < snap["kv_bytes_fp16"]
    assert snap["kv_fraction_of_fp16"] == pytest.approx(snap["kv_bytes"] / snap["kv_bytes_fp16"])
    assert snap["kv_fraction_of_fp16"] < 1


@pytest.mark.real_model
def test_generate_text_output(capsys):
    code, out, err = run_cli(capsys, "generate", "--method", "streaming_llm", "--set", "stream_window_size=16",
                             "--prompt", "What is the capital of France?", "--max-tokens", "8")
    assert code == 0, err
    for label in ("prompt tokens", "generated tokens", "decode tok/s", "kv_bytes", "kv_bytes_fp16", "kv_fraction_of_fp16"):
        assert f"{label}:" in out
    assert "x smaller" in out and "ratio" not in out


@pytest.mark.real_model
def test_demo_small_context(capsys):
    code, out, err = run_cli(capsys, "demo", "--methods", "snapkv,streaming_llm,kivi", "--context", "300",
                             "--max-tokens", "6")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("method"))
    for column in ("answer", "correct", "KV bytes", "kv_fraction_of_fp16", "decode tok/s", "agreement"):
        assert column in header
    rows = {line.split()[0]: line for line in lines[lines.index(header) + 2:] if line and not line[0].isupper()
            and line.split()[0] in ("none", "snapkv", "streaming_llm", "kivi")}
    assert "none" in rows and rows["none"].rstrip().endswith("1.00")
    for m in ("snapkv", "streaming_llm", "kivi"):
        if method_info(m).implemented:
            assert m in rows
        else:
            assert m not in rows and f"skipping {m}" in err
    assert "[1/" in err  # progress on stderr


# --------------------------------------------------------------------------- --model
def test_non_llama_gguf_is_refused_in_one_line(capsys, tmp_path):
    path = tmp_path / "gemma.gguf"
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((8, 4))}, {"general.architecture": "gemma2"})
    for cmd in (["generate", "--method", "kivi", "--prompt", "hi"], ["cache", "save", "--method", "kivi",
                                                                      "--prompt-file", str(prompt), "--out",
                                                                      str(tmp_path / "c")]):
        code, out, err = run_cli(capsys, *cmd, "--model", str(path))
        assert code == 2 and out == ""
        errors = [line for line in err.splitlines() if not line.startswith("[")]  # progress lines start "[ 0.0s]"
        assert len(errors) == 1 and "'gemma2'" in errors[0] and "llama" in errors[0] and "Traceback" not in err
    code, _, err = run_cli(capsys, "generate", "--method", "kivi", "--prompt", "hi", "--model",
                           str(tmp_path / "missing.gguf"))
    assert code == 2 and "no such file" in err
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    code, _, err = run_cli(capsys, "generate", "--method", "kivi", "--prompt", "hi", "--model", str(not_gguf))
    assert code == 2 and "not a .gguf" in err


# --------------------------------------------------------------------------- progress
class _Stream:
    def __init__(self, tty):
        self.tty, self.parts = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


def test_progress_lines_bars_and_quiet():
    from veloxquant_mlx.cli_output import Progress

    log = _Stream(tty=False)
    p = Progress(total=2, stream=log)
    p("first")
    for done in (0, 2048, 4096, 5000, 5000):  # mlx_lm reports the start and the last chunk twice
        p.chunk(done, 5000)
    p("second")
    p.close("done")
    text = "".join(log.parts)
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split("] ", 1)[1] for ln in lines if "] " in ln] == ["1/2 first", "2/2 second", "done"]
    assert [ln.strip().split(" (")[0] for ln in lines if "prefill" in ln] == [
        "prefill 2048/5000 tokens", "prefill 4096/5000 tokens", "prefill 5000/5000 tokens"]

    quiet = _Stream(tty=False)
    q = Progress(total=3, enabled=False, stream=quiet)
    q("x")
    q.chunk(10, 20)
    q.stage("y")
    q.note("z")
    q.close("w")
    assert quiet.parts == []

    term = _Stream(tty=True)
    t = Progress(total=2, stream=term)
    t("a")
    t.chunk(100, 200)
    t.chunk(200, 200)
    t("b")
    t.close()
    drawn = "".join(term.parts)
    assert "\r" in drawn and "prefill" in drawn and "2/2" in drawn  # tqdm bars, redrawn in place


def test_every_option_of_every_subcommand_has_help():
    import argparse

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + [name])
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(" ".join(path + [action.option_strings[0] if action.option_strings else action.dest]))

    walk(cli._parser(), ["veloxquant"])
    assert not missing, missing


def test_decode_concurrency_help_names_the_batched_methods_as_the_readme_does():
    import re

    from veloxquant_mlx.cache.base import implemented_class as _implemented_class

    serve = cli._parser()._subparsers._group_actions[0].choices["serve"]
    text = next(a.help for a in serve._actions if "--decode-concurrency" in a.option_strings)
    batched = {m for m in METHOD_NAMES if getattr(_implemented_class(m), "batchable", False)}
    assert batched == {"kivi", "turboquant_rvq", "waterfill", "streaming_llm"}
    assert set(re.findall(r"\b(?:%s)\b" % "|".join(METHOD_NAMES), text)) == batched
    assert "one request at a time" in text
    serving = (REPO / "README.md").read_text().split("## Serving", 1)[1].split("\n## ", 1)[0]
    assert all(name in serving for name in ("KIVI", "TurboQuant-RVQ", "Waterfill", "StreamingLLM"))
    assert "one at a time" in serving


@pytest.mark.real_model
def test_encode_turn_is_the_chat_template_without_its_start():
    from veloxquant_mlx.model import load_model

    _, tok = load_model()
    turn = cli.encode_turn(tok, "Summarize the text above.")
    whole = cli.encode_prompt(tok, "Summarize the text above.")
    assert whole[-len(turn):] == turn and len(turn) < len(whole)  # the conversation's start is left out
    text = tok.decode(turn)
    assert text.startswith("<|im_start|>user\nSummarize the text above.") and text.endswith("<|im_start|>assistant\n")
    assert "system" not in text


def test_serve_and_eval_refuse_another_methods_field_before_loading_a_model(capsys):
    code, _, err = run_cli(capsys, "serve", "--method", "kivi", "--set", "snap_budget=256", "--port", "0")
    assert code == 2 and "method 'kivi' has no setting 'snap_budget'" in err
    code, _, err = run_cli(capsys, "eval", "--method", "kivi", "--set", "kivi:window_size=8", "--task", "kld")
    assert code == 2 and "method 'kivi' has no setting 'window_size'" in err
    code, _, err = run_cli(capsys, "eval", "--method", "kivi", "--set", "snap_budget=8", "--task", "kld")
    assert code == 2 and "applies to none of the methods measured" in err


@pytest.mark.parametrize("method, held, note", [("snapkv", 1_216_800, True), ("snapkv", 311_040, False),
                                                ("none", 2_073_600, False)])
def test_text_output_names_the_fraction_and_explains_one_above_fp16(capsys, method, held, note):
    fp16 = 1_036_800
    out = {"method": method, "text": "Paris.", "generated_tokens": 2, "decode_tps": 3.0, "kv_tokens": 45,
           "kv_bytes": held, "kv_bytes_fp16": fp16, "kv_fraction_of_fp16": measure.kv_fraction_of_fp16(held, fp16)}
    assert cli.print_generation(out, [("method", method)], as_json=False) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("kv_fraction_of_fp16:"))
    assert f"{held / fp16:.2f} ({measure.compression_text(held / fp16)})" in line
    assert ("note: above 1" in text) is note


def test_compression_text_is_the_inverse_in_words():
    assert measure.kv_fraction_of_fp16(30, 100) == 0.3 and measure.kv_fraction_of_fp16(5, 0) is None
    assert measure.compression_text(0.3) == "3.3x smaller"
    assert measure.compression_text(1.17) == "1.2x larger"
    assert measure.compression_text(1.0) == "same size as fp16" and measure.compression_text(None) == "n/a"
    assert measure.fraction_text(0.25) == "0.25 (4.0x smaller)"


# --------------------------------------------------------------------------- layering
def cli_imports(package: Path) -> list[str]:
    """``path:line module`` for every import of a ``cli*`` module by a module of ``package`` that is not
    itself part of the command line (``cli*.py``, ``__main__.py``)."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if path.parent == package and (path.name.startswith("cli") or path.name == "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                # resolve ``from ..cli import x`` / ``from . import cli`` against the module's package
                base = list(rel.parent.parts)[: len(rel.parent.parts) - max(node.level - 1, 0)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            parts = [t.split(".") for t in targets]
            hits = {p[1] for p in parts if len(p) > 1 and p[0] == package.name
                    and (p[1] == "cli" or p[1].startswith("cli_"))}
            found += [f"{rel}:{node.lineno} {package.name}.{m}" for m in sorted(hits)]
    return sorted(found)


def test_no_library_module_imports_the_command_line(tmp_path):
    """The CLI is the top layer: settings from strings live in ``cache.settings``, generation in
    ``generate``; nothing below imports ``cli*``."""
    assert cli_imports(REPO / "veloxquant_mlx") == []
    # the check sees the kinds of import the tree had before (server.py, eval/specs.py)
    pkg = tmp_path / "veloxquant_mlx"
    (pkg / "eval").mkdir(parents=True)
    (pkg / "server.py").write_text("def f():\n    from .cli import UsageError\n")
    (pkg / "eval" / "specs.py").write_text("from ..cli import build_config\nfrom .. import cli_measure\n")
    (pkg / "bench.py").write_text("import veloxquant_mlx.cli_cache\nfrom .clip import x\n")
    (pkg / "cli_output.py").write_text("from .cli import main\n")  # the CLI's own modules may
    assert cli_imports(pkg) == ["veloxquant_mlx/bench.py:1 veloxquant_mlx.cli_cache",
                                "veloxquant_mlx/eval/specs.py:1 veloxquant_mlx.cli",
                                "veloxquant_mlx/eval/specs.py:2 veloxquant_mlx.cli_measure",
                                "veloxquant_mlx/server.py:2 veloxquant_mlx.cli"]
