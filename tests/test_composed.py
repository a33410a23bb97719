"""Quantized eviction (``cache/composed.py``): an eviction method keeps the rows it would keep, stored as a
quantizer's codes, attention runs on those codes, ``nbytes`` is what both parts hold, and it saves, loads
and is configured from strings. The mlx_lm contract itself runs in test_contract.py (rows
``snapkv+waterfill`` and ``pyramidkv+kivi`` of contract_table.py) and test_memory_honesty.py."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401,I001  (first: OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from tiny_models import VOCAB, tiny_llama  # noqa: E402
from veloxquant_mlx.cache import (H2OOptions, KIVIOptions, KVCacheBuilder, KVCacheConfig, KVCacheFactory,  # noqa: E402
                                  PyramidKVOptions, QuantizerConfigError, SnapKVOptions, WaterfillOptions,
                                  dispatch, load_cache, save_cache)
from veloxquant_mlx.cache.composed import QuantizedEviction, quant_config  # noqa: E402
from veloxquant_mlx.cache.settings import UsageError, build_config, parse_sets  # noqa: E402
from veloxquant_mlx.eval.specs import resolve_methods  # noqa: E402

PROMPT = [(i * 29 + 5) % VOCAB for i in range(150)]
EVICTORS = {  # method -> options evicting the 150-token prompt to 48-60 rows per head
    "snapkv": SnapKVOptions(budget=48, obs_window=8, n_sink=2),
    "h2o": H2OOptions(budget=48, n_sink=2, grace=8),
    "pyramidkv": PyramidKVOptions(budget=60, n_sink=2),
}
QUANTIZERS = {"kivi": KIVIOptions(group_size=16), "waterfill": WaterfillOptions(residual_length=16)}
FLAT = dict(bit_width_inlier=4, n_calib_tokens=16)  # waterfill calibrates on 16 rows: the kept rows get coded


def composed_config(method, quantizer, **flat):
    opts = dataclasses.replace(EVICTORS[method], quantize=QUANTIZERS[quantizer])
    return KVCacheConfig(method=method, options=opts, **{**FLAT, **flat})


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=32, n_layers=3)


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("method", list(EVICTORS))
def test_kept_positions_are_the_plain_methods(model, method, quantizer):
    """One prefill call: the eviction runs on the dense rows with the real queries, as the plain method's
    does, so every layer and head keeps exactly the plain method's positions -- then holds them as codes."""
    plain = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, options=EVICTORS[method]))
    comp = KVCacheBuilder.for_model(model, composed_config(method, quantizer))
    for caches in (plain, comp):
        mx.eval(model(mx.array([PROMPT]), cache=caches))
    for p, c in zip(plain, comp):
        assert isinstance(c, QuantizedEviction) and c.frozen and c.evict.keys is None
        assert c.stored_rows() == p.rows == c.quantized_rows < len(PROMPT)
        assert bool(mx.array_equal(c.evict.positions[:, :, : c.stored_rows()], p.positions[:, :, : p.rows]))


def _attention64(q, k, v, scale):
    """Softmax attention in float64 NumPy: q [B, Hq, N, D] over k, v [B, H, T, D] (GQA), no mask."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_decode_attention_is_dense_attention_over_the_dequantized_kept_rows(quantizer):
    """After the prefill, a decode step attends over the kept rows as the quantizer decodes them (plus the new
    row): equal to float64 attention over those rows; the decoded rows are the kept positions' true rows
    within the quantizer's error, and not the true rows themselves (they are stored quantized)."""
    dispatch.install()
    B, H, HQ, T, D = 1, 2, 4, 120, 32
    mx.random.seed(7)
    q, k, v = (mx.random.normal((B, h, T + 1, D)) for h in (HQ, H, H))
    scale = D ** -0.5
    c = KVCacheFactory.create(composed_config("snapkv", quantizer).replace(head_dim=D))
    K, V = c.update_and_fetch(k[:, :, :T], v[:, :, :T])
    mx.eval(c.attend(q[:, :, :T], K, V, scale=scale, mask="causal"))
    assert c.frozen and c.stored_rows() == 48
    pos = c.evict.positions[:, :, :48]
    kd, vd = c.quant._dense()
    true_k = mx.take_along_axis(k[:, :, :T], pos[..., None], axis=2)
    true_v = mx.take_along_axis(v[:, :, :T], pos[..., None], axis=2)
    for got, true in ((kd, true_k), (vd, true_v)):
        err, spread = float(mx.abs(got - true).max()), float(true.max() - true.min())
        assert 0 < err <= spread / (2 ** FLAT["bit_width_inlier"] - 1), (err, spread)  # within one 4-bit step
    K, V = c.update_and_fetch(k[:, :, T:], v[:, :, T:])
    out = c.attend(q[:, :, T:], K, V, scale=scale, mask=None)
    ref = _attention64(q[:, :, T:], mx.concatenate([kd, k[:, :, T:]], axis=2), mx.concatenate([vd, v[:, :, T:]], axis=2),
                       scale)
    assert np.abs(np.asarray(out, dtype=np.float64) - ref).max() <= 1e-4 * float(mx.abs(V).max())
    assert c.offset == T + 1 and c.stored_rows() == 49 and int(c.evict.positions[0, 0, 48]) == T


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_nbytes_is_the_arrays_both_parts_hold(model, quantizer):
    """``nbytes`` = the eviction part's bookkeeping (positions, votes) + the quantizer's arrays; no dense
    key/value rows are kept once a call is attended, through a chunked prefill and decode steps."""
    caches = KVCacheBuilder.for_model(model, composed_config("pyramidkv", quantizer))
    for a in (0, 64, 128):
        mx.eval(model(mx.array([PROMPT[a : a + 64]]), cache=caches))
    for t in (3, 9, 27):
        mx.eval(model(mx.array([[t]]), cache=caches))
    for c in caches:
        assert c.evict.keys is None and c.evict.values is None and c.offset == 153
        parts = c.evict.held_arrays() + c.quant.held_arrays()
        assert c.nbytes == sum(a.nbytes for a in parts) > 0
        assert c.quant.stored_rows() == c.stored_rows() == c.evict.rows <= c.evict.budget + 3


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_save_load_round_trip(model, quantizer, tmp_path):
    caches = KVCacheBuilder.for_model(model, composed_config("snapkv", quantizer))
    mx.eval(model(mx.array([PROMPT]), cache=caches))
    path = tmp_path / "c.safetensors"
    info = save_cache(path, caches, model_id="tiny", tokens=PROMPT, method="snapkv")
    assert info["layer_classes"] == ["QuantizedSnapKVKVCache"] * 3
    loaded, _ = load_cache(path, model=model, expect_method="snapkv")
    for a, b in zip(caches, loaded):
        assert type(a) is type(b) and (a.offset, a.stored_rows()) == (b.offset, b.stored_rows())
        assert b.config.options.quantize == QUANTIZERS[quantizer] and b.config.bit_width_inlier == 4
        assert bool(mx.array_equal(a.evict.positions[:, :, : a.stored_rows()], b.evict.positions[:, :, : b.stored_rows()]))
    for t in (5, 77, 12):  # both continue identically (decode on the codes)
        x, y = (model(mx.array([[t]]), cache=cs).astype(mx.float32) for cs in (caches, loaded))
        assert bool(mx.array_equal(x, y))


def test_a_forged_composed_file_is_refused(model, tmp_path):
    """Each part of a saved composed cache is checked as a cache of its own method (saved.py)."""
    import json

    from test_saved_cache import _forge
    from veloxquant_mlx.cache import SavedCacheError

    def quant_claims_an_eviction_method(arrays):
        m = json.loads("".join(chr(c) for c in arrays["0.quant.meta"].tolist()))
        m["config"] = json.dumps({**json.loads(m["config"]), "method": "snapkv"})
        arrays["0.quant.meta"] = mx.array([ord(c) for c in json.dumps(m)])

    caches = KVCacheBuilder.for_model(model, composed_config("snapkv", "kivi"))
    mx.eval(model(mx.array([PROMPT]), cache=caches))
    for edit, needle in ((quant_claims_an_eviction_method, "quantizer 'snapkv' is not an mlx_lm-protocol quantization"),
                         (lambda a: a.update({"1.evict.extra": mx.zeros(3)}), "arrays ['extra'] are not among")):
        path = tmp_path / "c.safetensors"
        save_cache(path, caches, model_id="tiny", tokens=PROMPT, method="snapkv")
        with pytest.raises(SavedCacheError, match=re.escape(needle)):
            load_cache(_forge(path, arrays_edit=edit), model=model)


def test_a_prefill_after_decode_re_evicts_to_the_budget(model):
    """A second prefill (a follow-up turn) thaws the codes, evicts what is over the budget, freezes again."""
    caches = KVCacheBuilder.for_model(model, composed_config("snapkv", "kivi"))
    mx.eval(model(mx.array([PROMPT]), cache=caches))
    for t in (1, 2, 3):
        mx.eval(model(mx.array([[t]]), cache=caches))
    assert [c.stored_rows() for c in caches] == [51] * 3
    mx.eval(model(mx.array([PROMPT[:40]]), cache=caches))
    assert all(c.frozen and c.stored_rows() == 48 and c.offset == 193 for c in caches)
    pos = np.array(caches[0].evict.positions[:, :, :48])
    assert (np.diff(pos, axis=-1) > 0).all() and (pos[..., -8:] == np.arange(185, 193)).all()  # window kept


def test_bad_settings_are_refused_by_name():
    with pytest.raises(QuantizerConfigError, match="quantize"):
        SnapKVOptions(quantize="snapkv")  # an eviction method is no storage layout
    with pytest.raises(QuantizerConfigError, match="quantize"):
        SnapKVOptions(quantize="turboquant_prod")  # standalone protocol
    with pytest.raises(QuantizerConfigError, match="decode_evict"):
        H2OOptions(quantize="kivi", decode_evict=True)
    with pytest.raises(UsageError, match="has no setting 'bit_width_inlier'.*with quantize=METHOD"):
        parse_sets(["bit_width_inlier=3"], method="snapkv")  # a quantizer's setting, but no quantizer chosen
    with pytest.raises(UsageError, match="quantize=METHOD"):
        build_config("snapkv", parse_sets(["waterfill:bit_width_inlier=3"], method="snapkv"))
    with pytest.raises(UsageError, match="kivi.*residual_length"):
        build_config("snapkv", parse_sets(["quantize=kivi", "residual_length=16"], method="snapkv"))


def test_settings_from_strings():
    """The command line's forms: the quantizer's shared fields stay flat, its own go into its options."""
    c = build_config("snapkv", parse_sets(["budget=64", "quantize=waterfill", "bit_width_inlier=3",
                                           "waterfill:residual_length=16"], method="snapkv"))
    assert c.options.budget == 64 and c.options.quantize == WaterfillOptions(residual_length=16)
    q = quant_config(c)
    assert (q.method, q.bit_width_inlier, q.options) == ("waterfill", 3, WaterfillOptions(residual_length=16))
    specs = resolve_methods(["snapkv budget=64 quantize=kivi"], ["snapkv:kivi:group_size=16"], include_none=False)
    assert [s.config().options.quantize for s in specs] == [KIVIOptions(group_size=16)]
    assert build_config("snapkv", parse_sets(["quantize=kivi"], method="snapkv")).options.quantize == "kivi"


# ------------------------------------------------------------------------------------------------ real model
# Issue 14 part 1's target on the embedded SmolLM2 (essays, 2048-token context + 64 scored decode steps; the
# figures of docs/data/composed_kld_2048_2026-12-01): a composed point at <= 0.15x the fp16 bytes with
# KLD <= 0.03, which waterfill at 2 bits (its 2-bit class point) does not reach at more bytes. Measured
# (mlx 0.32.4 CPU, float32, 2026-12-03, since waterfill fits its key ranges at <= 3 bits): snapkv budget 1024 +
# waterfill-3 KLD 0.0075 at 0.127x; waterfill-2 KLD 0.0275 at 0.160x (2026-12-01, before the fit: 0.0123 and
# 0.0801). The test holds the target and half the measured KLD gap (0.020).
COMPOSED_SPEC = ("snapkv", {"snap_budget": 1024, "quantize": "waterfill", "bit_width_inlier": 3,
                            "residual_length": 16})
WATERFILL2_SPEC = ("waterfill", {"bit_width_inlier": 2, "residual_length": 32})
KLD_MARGIN = 0.010


@pytest.mark.real_model
@pytest.mark.slow
def test_composed_point_beats_waterfill2_at_fewer_bytes():
    from veloxquant_mlx.eval.specs import MethodSpec
    from veloxquant_mlx.eval.tasks import eval_kld
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    specs = [MethodSpec(m, s).label for m, s in (COMPOSED_SPEC, WATERFILL2_SPEC)]
    comp, wf2 = eval_kld(model, tok, [MethodSpec(*COMPOSED_SPEC), MethodSpec(*WATERFILL2_SPEC)], context=2048,
                         n_score=64, include_none=False)
    summary = "; ".join(f"{r['label']}: KLD {r['kld']:.4f}, kv/fp16 {r['kv_fraction_of_fp16']:.3f}" for r in (comp, wf2))
    print(summary)
    assert [comp["label"], wf2["label"]] == specs and comp["error"] is None and wf2["error"] is None
    assert comp["kv_fraction_of_fp16"] <= min(0.15, wf2["kv_fraction_of_fp16"]), summary
    assert comp["kld"] <= 0.03 and comp["kld"] + KLD_MARGIN <= wf2["kld"], summary
