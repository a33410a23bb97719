"""Saved caches: ``save_cache`` / ``load_cache`` round trips, file sizes, errors, and the CLI.

Round trips and errors run on the tiny models of ``tiny_models.py``; the file-size ratio and the CLI
(``cache save``, ``cache info``, ``generate --prompt-cache``) use the embedded SmolLM2-135M.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from veloxquant_mlx import cli  # noqa: I001  (imports veloxquant_mlx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402

from veloxquant_mlx.cache import (  # noqa: E402
    KVCacheBuilder, KVCacheConfig, KVCacheFactory, SavedCacheError, load_cache, read_cache_info, save_cache,
)
from veloxquant_mlx.cache import saved as saved_mod  # noqa: E402
from veloxquant_mlx.measure import kv_bytes  # noqa: E402

T_TINY = 300
TOKENS = [(7 * i + 3) % 128 for i in range(T_TINY)]

# method -> extra config fields (windows / budgets below the prompt length, so compression happens)
ROUND_TRIP = {
    "none": None,
    "kivi": {"bit_width_inlier": 2, "kivi_group_size": 16},
    "turboquant_rvq": {},
    "kvquant": {},
    "snapkv": {"snap_budget": 64},
    "streaming_llm": {"stream_window_size": 32},
    "minicache": {},
    "xkv": {},
}


def _tiny(**kw):
    from tiny_models import tiny_llama

    return tiny_llama(n_layers=4, **kw)


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


def _prefilled(model, method, fields, tokens=TOKENS):
    if fields is None:
        caches = make_prompt_cache(model)
    else:
        caches = KVCacheBuilder.for_model(model, cli.build_config(method, fields))  # options dataclasses
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _assert_states_equal(a, b):
    sa, sb = tree_flatten([c.state for c in a]), tree_flatten([c.state for c in b])
    assert [k for k, _ in sa] == [k for k, _ in sb]
    for (key, x), (_, y) in zip(sa, sb):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array) and x.dtype == y.dtype and x.shape == y.shape, key
            assert mx.array_equal(x, y).item(), key
        else:
            assert x == y, key
    assert [c.offset for c in a] == [c.offset for c in b]


@pytest.fixture()
def kivi_file(tiny, tmp_path):
    caches = _prefilled(tiny, "kivi", ROUND_TRIP["kivi"])
    path = tmp_path / "kivi.safetensors"
    save_cache(path, caches, model_id="tiny-llama", tokens=TOKENS, method="kivi")
    return path


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("method", list(ROUND_TRIP))
def test_round_trip_is_bit_identical(tiny, tmp_path, method):
    caches = _prefilled(tiny, method, ROUND_TRIP[method])
    path = tmp_path / f"{method}.vqc"  # any file name works
    info = save_cache(path, caches, model_id="tiny-llama", tokens=TOKENS, method=method)
    assert info["file_bytes"] == os.path.getsize(path)
    loaded, linfo = load_cache(path, model=tiny, expect_method=method, expect_model_id="tiny-llama")
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    _assert_states_equal(caches, loaded)
    assert linfo["tokens"] == TOKENS and linfo["offset"] == T_TINY and linfo["n_layers"] == 4
    assert linfo["method"] == method and linfo["kv_bytes"] == kv_bytes(caches)
    assert linfo["head_shapes"] == [[2, 16, 16]] * 4
    # the next-token logits (and a few decode steps) agree exactly
    for tok in (5, 77, 12):
        want = tiny(mx.array([[tok]]), cache=caches)
        got = tiny(mx.array([[tok]]), cache=loaded)
        assert mx.array_equal(want, got).item()


def test_loaded_file_is_an_mlx_lm_prompt_cache(kivi_file, tiny):
    """A ``*.safetensors`` saved cache also loads with mlx_lm's own ``load_prompt_cache``."""
    ours, _ = load_cache(kivi_file)
    theirs = load_prompt_cache(str(kivi_file))
    _assert_states_equal(ours, theirs)


def test_cache_info_without_loading(kivi_file):
    info = read_cache_info(kivi_file)
    assert info["format"] == saved_mod.FORMAT_NAME and info["format_version"] == saved_mod.FORMAT_VERSION
    assert info["config"] == {"kivi_group_size": 16}  # the fields that differ from the defaults
    assert info["layer_classes"] == ["KIVIKVCache"] * 4 and info["n_tokens"] == T_TINY


def test_standalone_cache_cannot_be_saved(tmp_path):
    polar = KVCacheFactory.create(KVCacheConfig(method="polar", head_dim=16))
    with pytest.raises(SavedCacheError, match="standalone-protocol"):
        save_cache(tmp_path / "p.safetensors", [polar], model_id=None, tokens=[], method="polar")
    assert not os.listdir(tmp_path)  # nothing (not even a temporary file) is left behind


def test_save_checks_its_arguments(tiny, tmp_path):
    caches = _prefilled(tiny, "kivi", ROUND_TRIP["kivi"])
    out = tmp_path / "x.safetensors"
    with pytest.raises(SavedCacheError, match="299 ids but the caches have seen 300"):
        save_cache(out, caches, model_id=None, tokens=TOKENS[:-1], method="kivi")
    with pytest.raises(SavedCacheError, match="holds a 'kivi' cache but method='snapkv'"):
        save_cache(out, caches, model_id=None, tokens=TOKENS, method="snapkv")
    with pytest.raises(SavedCacheError, match="'kivy' is not a method name"):
        save_cache(out, caches, model_id=None, tokens=TOKENS, method="kivy")
    with pytest.raises(SavedCacheError, match="does not exist"):
        save_cache(tmp_path / "no" / "x.safetensors", caches, model_id=None, tokens=TOKENS, method="kivi")
    assert not os.listdir(tmp_path)


# --------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(SavedCacheError, match=r"nope\.safetensors: no such file"):
        load_cache(tmp_path / "nope.safetensors")


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text, not a cache at all")
    with pytest.raises(SavedCacheError, match="notes.txt: not a safetensors file"):
        load_cache(path)


def test_truncated_file(kivi_file):
    data = kivi_file.read_bytes()
    kivi_file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(SavedCacheError, match=r"kivi\.safetensors: truncated: the header describes \d+ data "
                                              r"bytes but the file holds only \d+"):
        load_cache(kivi_file)
    kivi_file.write_bytes(data[:200])  # cut inside the header
    with pytest.raises(SavedCacheError, match="not a safetensors file, or truncated"):
        load_cache(kivi_file)


def test_flipped_header_bytes(kivi_file):
    data = kivi_file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for frac in (0.02, 0.2, 0.4, 0.6, 0.8, 0.98):
        pos = 8 + int(n * frac)
        bad = bytearray(data)
        bad[pos] ^= 0x01
        bad[pos + 1] ^= 0x04
        kivi_file.write_bytes(bytes(bad))
        with pytest.raises(SavedCacheError, match="kivi.safetensors: corrupt"):
            load_cache(kivi_file)


def test_flipped_data_bytes(kivi_file):
    data = bytearray(kivi_file.read_bytes())
    data[-100] ^= 0xFF
    kivi_file.write_bytes(bytes(data))
    with pytest.raises(SavedCacheError, match="corrupt: checksum mismatch"):
        read_cache_info(kivi_file)


def test_plain_mlx_lm_file_is_not_a_veloxquant_cache(tiny, tmp_path):
    path = tmp_path / "plain.safetensors"
    save_prompt_cache(str(path), _prefilled(tiny, "none", None))
    with pytest.raises(SavedCacheError, match="not a veloxquant saved cache"):
        load_cache(path)


def test_unknown_format_version(tiny, tmp_path, monkeypatch):
    path = tmp_path / "future.safetensors"
    monkeypatch.setattr(saved_mod, "FORMAT_VERSION", 99)
    save_cache(path, _prefilled(tiny, "kivi", ROUND_TRIP["kivi"]), model_id=None, tokens=TOKENS, method="kivi")
    monkeypatch.undo()
    with pytest.raises(SavedCacheError, match="unknown saved-cache format version 99"):
        load_cache(path)


def test_method_mismatch(kivi_file):
    with pytest.raises(SavedCacheError, match="method mismatch: the file holds a 'kivi' cache, expected 'snapkv'"):
        load_cache(kivi_file, expect_method="snapkv")


def test_model_mismatch(kivi_file):
    with pytest.raises(SavedCacheError, match="model mismatch: layer 0 of the cache holds 2 KV heads of dimension "
                                              "16 .* has 2 KV heads of dimension 32"):
        load_cache(kivi_file, model=_tiny(head_dim=32))
    from tiny_models import tiny_llama

    with pytest.raises(SavedCacheError, match="model mismatch: the cache has 4 layers .* the given model has 3"):
        load_cache(kivi_file, model=tiny_llama(n_layers=3))
    with pytest.raises(SavedCacheError, match="model mismatch: the cache was saved with model 'tiny-llama', "
                                              "not 'smollm2-135m'"):
        load_cache(kivi_file, expect_model_id="SmolLM2-135M-Instruct")


def test_sliding_window_layers_round_trip_and_are_checked(tmp_path):
    """Gemma-3 style models: kivi's compressed rings (sliding layers) next to its full-layer caches."""
    from tiny_models import tiny_gemma3

    model = tiny_gemma3()
    caches = _prefilled(model, "kivi", {"bit_width_inlier": 4}, TOKENS[:100])
    path = tmp_path / "g.safetensors"
    save_cache(path, caches, model_id="tiny-gemma3", tokens=TOKENS[:100], method="kivi")
    loaded, _ = load_cache(path, model=model)
    _assert_states_equal(caches, loaded)
    with pytest.raises(SavedCacheError, match="model mismatch: layer 0 of the cache holds a RotatingKIVICache, the "
                                              "given model's layer 0 uses a KVCache"):
        load_cache(path, model=_tiny())
    llama_file = tmp_path / "l.safetensors"
    save_cache(llama_file, _prefilled(_tiny(), "none", None), model_id=None, tokens=TOKENS, method="none")
    with pytest.raises(SavedCacheError, match="model mismatch: layer 0 of the cache holds a KVCache, the given "
                                              "model's layer 0 uses a RotatingKVCache"):
        load_cache(llama_file, model=model)


# --------------------------------------------------------------------------- file size (real model)


@pytest.fixture(scope="module")
def smol():
    from veloxquant_mlx.model import load_model

    return load_model(None)


@pytest.mark.real_model
def test_file_size_follows_the_compression_ratio(smol, tmp_path):
    from veloxquant_mlx.assets import essays_text

    model, tokenizer = smol
    tokens = tokenizer.encode(essays_text(max_chars=6000))[:512]
    assert len(tokens) == 512
    sizes = {}
    for method, cfg in (("none", None), ("kivi", {"bit_width_inlier": 2})):
        caches = make_prompt_cache(model) if cfg is None else KVCacheBuilder.for_model(
            model, cli.build_config(method, cfg))
        model(mx.array([tokens]), cache=caches)
        info = save_cache(tmp_path / f"{method}.safetensors", caches, model_id=None, tokens=tokens, method=method)
        sizes[method] = (info["kv_bytes"], info["file_bytes"])
    nbytes_ratio = sizes["kivi"][0] / sizes["none"][0]
    file_ratio = sizes["kivi"][1] / sizes["none"][1]
    assert nbytes_ratio < 0.2
    assert file_ratio == pytest.approx(nbytes_ratio, rel=0.15)


# --------------------------------------------------------------------------- CLI (real model)


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


PROMPT = "\n\nIn one sentence, the text above says that"


@pytest.fixture(scope="module")
def doc_file(tmp_path_factory):
    from veloxquant_mlx.assets import essays_text

    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(essays_text(max_chars=1500), encoding="utf-8")
    return path


@pytest.mark.real_model
@pytest.mark.parametrize("method,sets", [("none", []), ("kivi", ["bit_width_inlier=4"])])
def test_cli_save_then_generate_matches_the_full_prompt(capsys, smol, doc_file, tmp_path, method, sets):
    model, tokenizer = smol
    out = tmp_path / "doc.safetensors"
    set_args = [a for s in sets for a in ("--set", s)]
    code, stdout, err = run_cli(capsys, "cache", "save", "--method", method, *set_args, "--prompt-file",
                                str(doc_file), "--out", str(out), "--json")
    assert code == 0, err
    saved = json.loads(stdout)
    doc_ids = tokenizer.encode(doc_file.read_text(encoding="utf-8"))
    assert saved["tokens"] == len(doc_ids) > 300 and saved["file_bytes"] == os.path.getsize(out)
    assert saved["kv_bytes_fp16"] == 30 * 2 * 3 * 64 * 2 * len(doc_ids)

    code, stdout, err = run_cli(capsys, "cache", "info", str(out))
    assert code == 0, err
    for label in ("format", "method", "model", "layers", "head shapes", "tokens", "kv_bytes", "file_bytes"):
        assert f"{label}:" in stdout
    assert "30 x [3, 64, 64]" in stdout and method in stdout

    code, stdout, err = run_cli(capsys, "generate", "--prompt-cache", str(out), "--prompt", PROMPT,
                                "--max-tokens", "6", "--json")
    assert code == 0, err
    got = json.loads(stdout)
    assert got["method"] == method and got["cached_tokens"] == len(doc_ids)
    prompt_ids = cli.encode_turn(tokenizer, PROMPT)  # a new user turn of the chat template
    assert got["prompt_tokens"] == len(prompt_ids)

    # the same greedy tokens as one generation over the whole text, without a saved cache
    config = None if method == "none" else cli.build_config(method, cli.parse_sets(sets))
    full = cli.run_generation(model, tokenizer, doc_ids + prompt_ids, cli.make_caches(model, method, config), 6)
    assert got["tokens"] == full["tokens"]

    # --method / --model given and matching the file: same result; text output has the usual labels
    code, stdout, err = run_cli(capsys, "generate", "--prompt-cache", str(out), "--method", method, "--model",
                                "smollm2-135m", "--prompt", PROMPT, "--max-tokens", "6")
    assert code == 0, err
    for label in ("prompt cache", "prompt tokens", "generated tokens", "kv_bytes", "kv_bytes_fp16", "kv_fraction_of_fp16"):
        assert f"{label}:" in stdout


@pytest.mark.real_model
def test_cli_errors(capsys, doc_file, tmp_path):
    out = tmp_path / "doc.safetensors"
    code, _, err = run_cli(capsys, "cache", "save", "--method", "streaming_llm", "--set", "stream_window_size=32",
                           "--prompt-file", str(doc_file), "--out", str(out))
    assert code == 0, err

    code, _, err = run_cli(capsys, "generate", "--prompt-cache", str(out), "--method", "kivi", "--prompt", "hi")
    assert code == 2 and "method mismatch" in err and "'streaming_llm'" in err
    code, _, err = run_cli(capsys, "generate", "--prompt-cache", str(out), "--set", "stream_window_size=8",
                           "--prompt", "hi")
    assert code == 2 and "--set does not apply with --prompt-cache" in err
    code, _, err = run_cli(capsys, "generate", "--prompt-cache", str(tmp_path / "missing.safetensors"),
                           "--prompt", "hi")
    assert code == 2 and "missing.safetensors: no such file" in err
    out.write_bytes(out.read_bytes()[:-10])
    code, _, err = run_cli(capsys, "generate", "--prompt-cache", str(out), "--prompt", "hi")
    assert code == 2 and "truncated" in err
    code, _, err = run_cli(capsys, "cache", "info", str(out))
    assert code == 2 and "truncated" in err


def test_cli_usage_errors(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert code == 2 and "--method" in err and "--prompt-cache" in err
    code, _, err = run_cli(capsys, "cache", "save", "--method", "kivi", "--prompt-file", str(tmp_path / "no.txt"),
                           "--out", str(tmp_path / "x.safetensors"))
    assert code == 2 and "no.txt" in err and "no such file" in err
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    code, _, err = run_cli(capsys, "cache", "save", "--method", "polar", "--prompt-file", str(doc),
                           "--out", str(tmp_path / "x.safetensors"))
    assert code == 2 and "polar" in err and "standalone" in err
    code, _, err = run_cli(capsys, "cache", "save", "--method", "kivy", "--prompt-file", str(doc),
                           "--out", str(tmp_path / "x.safetensors"))
    assert code == 2 and "unknown method 'kivy'" in err
    code, _, err = run_cli(capsys, "cache", "save", "--method", "kivi", "--prompt-file", str(doc),
                           "--out", str(tmp_path / "no" / "x.safetensors"))
    assert code == 2 and "does not exist" in err
    assert cli.main(["cache"]) == 2  # a cache subcommand is required


# --------------------------------------------------------------------------- forged files (issue 13, item 18)
#
# The checksum only catches accidents: ``_forge`` edits a file as anyone could and recomputes it, so these
# files pass the checksum and must be refused by the validation of what they say.


def _forge(path, *, info=None, layer_meta=None, classes=None, arrays_edit=None):
    """Rewrite the saved file ``path``: ``info(dict)`` edits the veloxquant metadata, ``layer_meta(i, dict)``
    each compressed layer's meta, ``classes(i, name)`` returns each layer's class name (in both places
    the file lists it), ``arrays_edit(dict)`` the arrays; then the checksum is recomputed."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta = {k: v for k, v in meta.items() if k != saved_mod._SUM_KEY}
    record = json.loads(meta[saved_mod._INFO_KEY])
    if info is not None:
        info(record)
    if classes is not None:
        names = [classes(i, n) for i, n in enumerate(record["layer_classes"])]
        if "layer_classes" in record:
            record["layer_classes"] = names
        for i, n in enumerate(names):
            meta[f"1.{i}"] = n
    meta[saved_mod._INFO_KEY] = json.dumps(record)
    if layer_meta is not None:
        for key in [k for k in arrays if k.endswith(".meta")]:
            m = json.loads("".join(chr(c) for c in arrays[key].tolist()))
            layer_meta(int(key.split(".")[0]), m)
            arrays[key] = mx.array([ord(c) for c in json.dumps(m)])
    if arrays_edit is not None:
        arrays_edit(arrays)
    raw = path.with_name(path.name + ".raw.safetensors")
    mx.save_safetensors(str(raw), arrays, meta)
    saved_mod._write_with_checksum(str(raw), str(path))
    raw.unlink()
    return path


@pytest.fixture()
def none_file(tiny, tmp_path):
    path = tmp_path / "none.safetensors"
    save_cache(path, _prefilled(tiny, "none", None), model_id="tiny-llama", tokens=TOKENS, method="none")
    return path


def _set(key, value):
    def edit(d):
        d[key] = value
    return edit


def _drop(key):
    return lambda d: d.pop(key)


def _scalars(**extra):
    return lambda i, m: m["scalars"].update(extra)


@pytest.mark.parametrize("edit, needle", [
    (dict(info=_set("offset", 10 ** 12), layer_meta=lambda i, m: m.update(offset=10 ** 12)),
     "'offset' = 1000000000000 does not equal 'n_tokens' (300)"),
    (dict(info=_set("n_tokens", 10 ** 12)), "'offset' = 300 does not equal 'n_tokens' (1000000000000)"),
    (dict(layer_meta=lambda i, m: m.update(offset=10 ** 12)), "offset 1000000000000 differs from the file's 300"),
    (dict(info=_set("tokens", [-1] + TOKENS[1:])), "'tokens' must be token ids"),
    (dict(info=_set("n_layers", 10 ** 9)), "'n_layers' = 1000000000 is outside"),
    (dict(info=_set("head_shapes", [[2, 10 ** 9, 16]] * 4)), "'head_shapes[0]' must be null or [H_kv, D_key"),
    (dict(info=_set("state_bytes", 10 ** 15)), "'state_bytes' = 1000000000000000 is more than the file's"),
    (dict(info=_set("method", "snapkv")), "layer 0 holds a 'kivi' cache but the file says method 'snapkv'"),
    (dict(info=_set("method", "os")), "'method' 'os' is not a method name"),
    (dict(layer_meta=lambda i, m: m.update(config=json.dumps({"method": "snapkv"}))),
     "holds a 'kivi' cache configured for 'snapkv', but the file says method 'kivi'"),
    (dict(layer_meta=lambda i, m: m.update(config=json.dumps({"method": "kivi", "dtype": "random"}))),
     "dtype 'random' is not one of float16, bfloat16, float32"),
    (dict(layer_meta=lambda i, m: m.update(config=json.dumps({"method": "kivi", "store": "os.system"}))),
     "are never saved"),
    (dict(layer_meta=_scalars(_dense=1)), "scalars ['_dense'] are not attributes KIVIKVCache declares"),
    (dict(layer_meta=_scalars(__dict__={})), "scalars ['__dict__'] are not attributes"),
    (dict(layer_meta=_scalars(__class__="KVCache")), "scalars ['__class__'] are not attributes"),
    (dict(layer_meta=_scalars(update_and_fetch=0)), "scalars ['update_and_fetch'] are not attributes"),
    (dict(layer_meta=_scalars(n_res={"a": 1})), "scalar 'n_res' must be a number"),
    (dict(layer_meta=lambda i, m: m.update(shape=[2, 16, 64])), "head shape [2, 16, 64] differs from the recorded"),
    (dict(layer_meta=lambda i, m: m.update(extra=1)), "its meta must have exactly config, offset, scalars and shape"),
    (dict(classes=lambda i, n: "os"), "layer 0 is 'os'; a 'kivi' file may hold only"),
    (dict(classes=lambda i, n: "__builtins__"), "layer 0 is '__builtins__'"),
    (dict(classes=lambda i, n: "_BaseCache"), "layer 0 is '_BaseCache'"),
    (dict(classes=lambda i, n: "CacheList"), "layer 0 is 'CacheList'"),
    (dict(info=_set("layer_classes", [["KIVIKVCache"]] * 4)), """layer 0 is "['KIVIKVCache']"; a 'kivi' file"""),
    (dict(info=_set("layer_classes", [{"a": 1}] * 4)), "layer 0 is \"{'a': 1}\"; a 'kivi' file"),
    (dict(classes=lambda i, n: "SnapKVKVCache"), "layer 0 holds a 'snapkv' cache but the file says method 'kivi'"),
    (dict(arrays_edit=lambda a: a.update({"0.evil": mx.zeros((1,))})), "arrays ['evil'] are not among the class's"),
])
def test_forged_kivi_file_is_refused_naming_the_field(kivi_file, tiny, edit, needle):
    _forge(kivi_file, **edit)
    with pytest.raises(SavedCacheError, match="kivi.safetensors: corrupt") as err:
        load_cache(kivi_file, model=tiny)
    assert needle in str(err.value)


@pytest.mark.parametrize("key", ["library_version", "method", "config", "model_id", "n_layers", "layer_classes",
                                 "head_shapes", "offset", "n_tokens", "tokens", "kv_bytes", "state_bytes"])
def test_missing_metadata_keys_are_a_saved_cache_error(kivi_file, key):
    _forge(kivi_file, info=_drop(key))
    with pytest.raises(SavedCacheError, match=f"corrupt veloxquant metadata: '{key}' is missing"):
        read_cache_info(kivi_file)


def test_missing_metadata_key_is_one_line_and_exit_2_in_the_cli(capsys, kivi_file):
    _forge(kivi_file, info=_drop("offset"))
    code, out, err = run_cli(capsys, "cache", "info", str(kivi_file))
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "'offset' is missing" in err and "Traceback" not in err


@pytest.mark.parametrize("edit, needle", [  # same byte sizes as the arrays they replace (KVCache: 512 rows)
    (lambda a: a.update({"0.0": mx.zeros((1, 4, 256, 16))}), "layer 0 (KVCache) is inconsistent with its recorded "
                                                             "head shape [2, 16, 16]"),
    (lambda a: a.update({"1.1": mx.zeros((1, 2, 256, 32))}), "layer 1 (KVCache) is inconsistent"),
    (lambda a: a.update({"2.0": mx.zeros((1, 2, 512, 16), dtype=mx.int32),
                         "2.1": mx.zeros((1, 2, 512, 16), dtype=mx.int32)}), "keys/values of dtype"),
])
def test_forged_plain_cache_arrays_are_refused(none_file, edit, needle):
    _forge(none_file, arrays_edit=edit)
    with pytest.raises(SavedCacheError, match="corrupt or forged") as err:
        load_cache(none_file)
    assert needle in str(err.value)


def test_forged_compressed_arrays_are_refused(kivi_file):
    """A KIVI layer whose float16 residual holds other heads than recorded."""
    arrays, _ = mx.load(str(kivi_file), return_metadata=True)
    name, array = next((k, v) for k, v in arrays.items() if k.startswith("0.") and v.ndim == 4 and v.shape[1] == 2)
    widened = mx.concatenate([array, array], axis=1)
    _forge(kivi_file, arrays_edit=lambda a: a.update({name: widened}))
    with pytest.raises(SavedCacheError, match="corrupt or forged: layer 0 \\(KIVIKVCache\\)"):
        load_cache(kivi_file)


def test_no_saved_file_runs_code_or_imports_modules(kivi_file, tiny, monkeypatch):
    """Class names and scalars naming modules, callables or dunder attributes are refused before any
    object is built: loading such files imports nothing and sets no attribute."""
    import sys

    clean = kivi_file.read_bytes()
    load_cache(kivi_file, model=tiny)  # warm: the modules a real load imports
    before = set(sys.modules)
    built = []
    for name in ("KIVIKVCache", "KVCache"):
        cls = getattr(__import__("mlx_lm.models.cache", fromlist=[name]), name)
        monkeypatch.setattr(cls, "from_state", classmethod(lambda c, state: built.append(c)), raising=True)
    attacks = [
        dict(classes=lambda i, n: "os.system"), dict(classes=lambda i, n: "subprocess"),
        dict(classes=lambda i, n: "mx"), dict(classes=lambda i, n: "__import__"),
        dict(info=_set("method", "__import__")), dict(layer_meta=_scalars(__reduce__="os.system")),
        dict(layer_meta=_scalars(__init_subclass__=1)),
        dict(layer_meta=lambda i, m: m.update(config=json.dumps({"method": "kivi", "dtype": "__builtins__"}))),
    ]
    for attack in attacks:
        kivi_file.write_bytes(clean)
        _forge(kivi_file, **attack)
        with pytest.raises(SavedCacheError):
            load_cache(kivi_file, model=tiny)
    assert built == []
    assert set(sys.modules) == before
