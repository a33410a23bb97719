"""waterfill: variable-width packing, reverse water-filling, RoPE inversion, and the cache's defining
properties -- bits follow the queries' channel energy times the key range, keys are quantized before
RoPE when the layer's RoPE is known, every quantized row costs exactly its bit budget, the float16
sinks and window are exact. (The mlx_lm contract: tests/test_quant_contract.py; quality on SmolLM2:
tests/test_quality_gate.py.)"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, QuantizerConfigError, dispatch
from veloxquant_mlx.cache.options import WaterfillOptions
from veloxquant_mlx.cache.methods.quantization.waterfill import WaterfillKVCache, allocate_bits, value_rotation
from veloxquant_mlx.cache.primitives.keygrid import FIT_ROWS, fit_rows, fits_ranges, fitted_range, range_margin
from veloxquant_mlx.cache.primitives.codebook import lloyd_max_distortion, nearest_code, odd_poly_gaussian
from veloxquant_mlx.cache.primitives.rope import apply_rope, rope_frequencies, rope_spec, rotate_rows
from veloxquant_mlx.cache.primitives.varpack import VarLayout

from tiny_models import tiny_llama

H, D = 2, 64


def make(bits=4, residual_length=16, n_calib=32, rope=None, D=D):
    """A standalone waterfill cache of head dim ``D``, bound to ``rope`` (an mlx RoPE module) when given."""
    c = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=bits, head_dim=D,
                                            n_calib_tokens=n_calib,
                                            options=WaterfillOptions(residual_length=residual_length)))
    assert isinstance(c, WaterfillKVCache)
    if rope is not None:
        c.bind_attention(type("Attn", (), {"rope": rope})())
    return c


# ------------------------------------------------------------------------------------------- varpack
@pytest.mark.parametrize("seed", range(6))
def test_varpack_round_trip_any_widths(seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 8 * D))
    widths = np.zeros((3, D), int)
    for g in range(3):  # random widths 0..8 with the same row total
        while widths[g].sum() < total:
            c = rng.integers(D)
            widths[g, c] += widths[g, c] < 8
    lay = VarLayout(widths)
    codes = rng.integers(0, 256, (2, 3, 7, D)) % (1 << widths)[None, :, None, :]
    words = lay.pack(mx.array(codes))
    assert words.shape == (2, 3, 7, -(-total // 32)) and words.dtype == mx.uint32
    assert (np.array(lay.unpack(words)) == codes).all()


def test_varpack_refuses_unequal_rows_and_wide_codes():
    with pytest.raises(ValueError, match="same total"):
        VarLayout([[4, 4], [4, 3]])
    with pytest.raises(ValueError, match="0..8"):
        VarLayout([[9, 0]])


# ------------------------------------------------------------------------------------ water-filling
def test_allocation_meets_the_budget_and_is_optimal():
    rng = np.random.default_rng(0)
    sens = np.exp(rng.normal(0, 3, (4, D)))
    w = np.array(allocate_bits(sens, 4 * D))
    assert w.shape == (4, D) and (w.sum(axis=1) == 4 * D).all() and w.min() >= 0 and w.max() <= 8
    # monotone: a more sensitive channel never gets fewer bits
    for g in range(4):
        order = np.argsort(sens[g])
        assert (np.diff(w[g, order]) >= 0).all()
    # optimal: moving one bit from any channel to any other never lowers sum_c s_c 4^-b_c
    dist = (sens * 4.0 ** -w).sum(axis=1)
    for g in range(4):
        for i in range(D):
            for j in range(D):
                if i != j and w[g, i] > 0 and w[g, j] < 8:
                    v = w[g].copy()
                    v[i] -= 1
                    v[j] += 1
                    assert (sens[g] * 4.0 ** -v).sum() >= dist[g] * (1 - 1e-12)


def test_allocation_equal_sensitivities_spread_evenly():
    w = np.array(allocate_bits(np.ones((1, D)), 3 * D))
    assert (w == 3).all()


@pytest.mark.parametrize("seed", range(4))
def test_allocation_on_the_device_is_the_greedy_one_ties_to_the_lower_channel(seed):
    """``allocate_bits`` (top gains by one sort, on the device) against the greedy rule written out on the host:
    each bit in turn to the largest ``log2 s_c - 2 b_c``, ties to the lower channel, on the same float32 gains."""
    rng = np.random.default_rng(seed)
    G, total = 3, int(rng.integers(0, 8 * D + 1))
    sens = np.exp(rng.normal(0, 3, (G, D))).astype(np.float32)
    sens[:, : D // 2] = np.round(sens[:, : D // 2])  # ties (and zeros) in half the channels
    got = np.array(allocate_bits(mx.array(sens), total))
    gain = np.array(mx.log2(mx.maximum(mx.array(sens), 1e-30)))  # the same float32 rounding as the device's
    want = np.zeros((G, D), int)
    for g in range(G):
        for _ in range(total):
            cur = gain[g] - (2.0 * want[g]).astype(np.float32)  # float32 throughout, as the device computes it
            c = int(np.argmax(np.where(want[g] < 8, cur, -np.inf)))  # the first maximum: the lowest channel
            want[g, c] += 1
    np.testing.assert_array_equal(got, want)


def test_a_layout_from_a_device_width_table_equals_the_host_one():
    rng = np.random.default_rng(7)
    widths = np.array(allocate_bits(np.exp(rng.normal(0, 2, (2, D))), 3 * D))
    host, device = VarLayout(widths), VarLayout(mx.array(widths), 3 * D)
    for a, b in zip(host.arrays(), device.arrays()):
        assert a.dtype == b.dtype and bool(mx.array_equal(a, b))
    with pytest.raises(ValueError, match="total_bits"):
        VarLayout(mx.array(widths))


def test_odd_poly_codebook_is_within_a_fraction_of_lloyd_max():
    x = mx.random.normal((400_000,), key=mx.random.key(0))
    for bits, rel in ((2, 0.002), (3, 0.004), (4, 0.006)):
        cents, (a, b, c) = odd_poly_gaussian(bits)
        u = mx.arange(1 << bits).astype(mx.float32) - ((1 << bits) - 1) / 2
        assert float(mx.abs(cents - (a * u + b * u**3 + c * u**5)).max()) < 1e-5
        err = x - cents[nearest_code(x, cents).astype(mx.int32)]
        assert float(mx.mean(err * err)) <= lloyd_max_distortion(bits) * (1 + rel) + 5e-4


# ------------------------------------------------------------------------------------------- rope
@pytest.mark.parametrize("traditional", [True, False])
def test_rope_spec_reproduces_and_inverts_the_layer(traditional):
    rope = nn.RoPE(D, traditional=traditional, base=10000.0)
    spec = rope_spec(rope)
    assert spec is not None and spec["traditional"] is traditional
    x = mx.random.normal((1, H, 9, D), key=mx.random.key(1))
    y = apply_rope(x, spec, 100)
    assert float(mx.abs(y - rope(x, offset=100)).max()) < 1e-5
    assert float(mx.abs(apply_rope(y, spec, 100, inverse=True) - x).max()) < 1e-4


@pytest.mark.parametrize("rope", [nn.RoPE(D, traditional=True, base=1e5), nn.RoPE(D, traditional=False, base=1e4),
                                  nn.RoPE(32, traditional=False, base=1e4, scale=0.5)])
def test_rotate_rows_matches_fast_rope_and_inverts_exactly(rope):
    """Angle-addition tables give MLX's RoPE up to float32 angle rounding (which grows with the
    position for both), and the inverse undoes the forward to float32 precision at any position."""
    spec = rope_spec(rope)
    omega = rope_frequencies(spec)
    x = mx.random.normal((1, H, 200, D), key=mx.random.key(2))
    for offset in (0, 3, 5000):
        y = rotate_rows(x, spec, omega, offset)
        assert float(mx.abs(y - apply_rope(x, spec, offset)).max()) < 1e-4 + 4e-7 * offset
        assert float(mx.abs(rotate_rows(y, spec, omega, offset, inverse=True) - x).max()) < 1e-5


def test_rope_constants_are_built_once_per_spec_and_shared():
    """A model's layers share one RoPE: the frequencies and the decode kernel's tables come back as the same arrays
    for equal specs (no host work per layer in a prefill's first chunk), and differ where the spec does."""
    from veloxquant_mlx.cache.kernels import waterfill as wf_kernel

    a, b = rope_spec(nn.RoPE(D, base=1e4)), rope_spec(nn.RoPE(D, base=1e4))
    assert a is not b and rope_frequencies(a) is rope_frequencies(b)
    assert all(x is y for x, y in zip(wf_kernel.rope_tables(a, D), wf_kernel.rope_tables(dict(b), D)))
    other = rope_spec(nn.RoPE(D, base=1e5))
    assert rope_frequencies(other) is not rope_frequencies(a)
    assert not np.allclose(np.array(rope_frequencies(other)), np.array(rope_frequencies(a)))
    w, partner, sign = (np.array(t) for t in wf_kernel.rope_tables(other, D))
    np.testing.assert_allclose(w, np.tile(np.array(rope_frequencies(other)), 2))  # non-traditional: c mod D/2


def test_rope_spec_unknown_layers_give_none():
    assert rope_spec(None) is None
    assert rope_spec(nn.Linear(4, 4)) is None

    class Scaled(nn.RoPE):  # extra magnitude scaling (YaRN's mscale): not a pure rotation
        mscale = 1.2

    assert rope_spec(Scaled(D)) is None


# ------------------------------------------------------------------------------------------- cache
def rows(n, scale=None, seed=0):
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
    if scale is not None:
        k = k * mx.array(scale, dtype=mx.float32)
    return k


def feed(c, k, v, queries=None):
    """One call the way mlx_lm's attention makes it (update_and_fetch, then the dispatch point)."""
    K, V = c.update_and_fetch(k, v)
    q = queries if queries is not None else mx.zeros((1, 2 * H, k.shape[2], D))
    mask = "causal" if k.shape[2] > 1 else None
    return dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=mask)


def test_window_until_calibrated_then_sinks_codes_window():
    c = make(n_calib=48)
    k, v = rows(40), rows(40, seed=1)
    feed(c, k, v)
    assert not c.calibrated and (c.n_sink, c.n_quant, c.n_win) == (0, 0, 40)  # below n_calib: all float16
    K, V = c._dense()
    assert bool(mx.array_equal(K, k.astype(mx.float16).astype(mx.float32)))
    feed(c, rows(30, seed=2), rows(30, seed=3))
    assert c.calibrated and c.saliency_source == "attention"
    # 70 rows: whole 16-row blocks beyond the newest 16 leave the window; the first 4 rows are sinks
    assert (c.n_sink, c.n_quant, c.n_win) == (4, 44, 22)
    K, V = c._dense()
    assert bool(mx.array_equal(K[:, :, :4], k[:, :, :4].astype(mx.float16).astype(mx.float32)))


@pytest.mark.parametrize("bits", [4, 8])
def test_key_levels_span_the_calibration_rows_widened_at_8_bits(bits):
    """Each channel's levels run from its calibration rows' minimum to their maximum (sinks excluded); at 8 bits
    widened by ``range_margin`` (a quarter of the span on each side), so that later keys a little past the first
    call's range are coded, not clamped (docs/RESULTS.md "Quality targets": KLD 3.9e-4 -> 3.7e-5 at 4096)."""
    c = make(bits=bits, n_calib=32)
    k = rows(64, seed=4)
    feed(c, k, rows(64, seed=1))
    body = np.array(k[0, :, 4:64], np.float64)  # no RoPE bound: the pre-RoPE keys are the keys
    lo, hi = body.min(axis=1), body.max(axis=1)
    m = 0.25 if bits == 8 else 0.0
    assert range_margin(bits) == m
    w = np.array(c.k_bits[0, :, 0]).astype(np.int64)
    k_lo, k_step = (np.array(a[0, :, 0].astype(mx.float32), np.float64) for a in (c.k_lo, c.k_step))
    span = hi - lo
    coded = w > 0
    tol = 2e-3 * np.abs(np.concatenate([lo, hi])).max() + 1e-3 * span.max()  # float16 storage of lo and step
    assert np.abs(k_lo - (lo - m * span))[coded].max() <= tol
    top = k_lo + k_step * ((1 << w) - 1)  # the step's float16 rounding, times the levels
    assert np.abs(top - (hi + m * span))[coded].max() <= tol + (1 + 2 * m) * span.max() * 2.0**-10
    assert (w[coded] > 0).all() and coded.sum() > D  # most channels coded


def _grid_sq_error(x, lo, hi, w):
    """float64 squared error per channel of uniform levels at widths ``w`` over [lo, hi] (0 bits: midpoint)."""
    L = (1 << w) - 1
    step = np.where(L > 0, (hi - lo) / np.maximum(L, 1), 0.0)
    codes = np.clip(np.round((x - lo) / np.where(step > 0, step, 1.0)), 0, L)
    q = np.where(L > 0, lo + step * codes, (lo + hi) / 2)
    return ((x - q) ** 2).sum(axis=-2)


def test_fitted_ranges_lower_the_squared_error_and_skip_unused_rows():
    """Heavy-tailed keys: per channel the fitted range codes the used rows with no more squared error than the
    min/max range (much less at 1-2 bits), sits inside it about the same midpoint, leaves 0-bit channels alone,
    and rows outside ``use`` (the sinks here, set to huge outliers) change nothing."""
    rng = np.random.default_rng(0)
    n, Hh, Dd = 300, 3, 16
    x = rng.standard_t(3, size=(1, Hh, n, Dd))
    widths = rng.integers(0, 5, size=(Hh, Dd))
    body = x[:, :, 4:]
    lo, hi = body.min(axis=2, keepdims=True), body.max(axis=2, keepdims=True)
    use = fit_rows([n], n, 4)
    assert int(use.sum()) == n - 4
    args = (mx.array(lo, dtype=mx.float32), mx.array(hi, dtype=mx.float32), mx.array(widths), use)
    fl, fh = (np.array(a, np.float64) for a in fitted_range(mx.array(x, dtype=mx.float32), *args))
    x2 = x.copy()
    x2[:, :, :4] = 1e3
    fl2, fh2 = (np.array(a, np.float64) for a in fitted_range(mx.array(x2, dtype=mx.float32), *args))
    assert np.array_equal(fl, fl2) and np.array_equal(fh, fh2)
    tol = 1e-6 * np.abs(np.concatenate([lo, hi])).max()
    assert (fl >= lo - tol).all() and (fh <= hi + tol).all() and np.allclose(fl + fh, lo + hi, atol=2 * tol)
    zero = widths[None, :, None, :] == 0
    assert np.allclose(fl[zero], lo[zero], atol=tol) and np.allclose(fh[zero], hi[zero], atol=tol)
    e_fit = _grid_sq_error(body, fl, fh, widths[None, :, None, :])
    e_minmax = _grid_sq_error(body, lo, hi, widths[None, :, None, :])
    assert (e_fit <= e_minmax * (1 + 1e-4) + 1e-9).all()
    low = (widths >= 1) & (widths <= 2)
    assert e_fit[0][low].sum() < 0.7 * e_minmax[0][low].sum()


def test_fit_rows_sample_each_sequence_past_its_sinks():
    m = np.array(fit_rows([10, 3, 3000], 3000, 4))[:, 0, :, 0]
    assert m[0].nonzero()[0].tolist() == list(range(4, 10))
    assert m[1].nonzero()[0].tolist() == [0, 1, 2]  # no rows past the sinks: all of them
    stride = -(-3000 // FIT_ROWS)
    assert m[2].nonzero()[0].tolist() == list(range(4, 3000, stride))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_key_ranges_fitted_at_three_bits_or_fewer(bits):
    """At <= 3 bits the calibrated key levels sit inside the calibration rows' range (the squared-error fit);
    at 4 bits they span it (``test_key_levels_span_the_calibration_rows_widened_at_8_bits``)."""
    assert fits_ranges(bits) == (bits <= 3)
    c = make(bits=bits, n_calib=32)
    k = mx.array(np.random.default_rng(1).standard_t(3, size=(1, H, 200, D)), dtype=mx.float32)
    feed(c, k, rows(200, seed=1))
    body = np.array(k[0, :, 4:200], np.float64)
    lo, hi = body.min(axis=1), body.max(axis=1)
    w = np.array(c.k_bits[0, :, 0]).astype(np.int64)
    k_lo, k_step = (np.array(a[0, :, 0].astype(mx.float32), np.float64) for a in (c.k_lo, c.k_step))
    top = k_lo + k_step * ((1 << w) - 1)
    coded = w > 0
    tol = 2e-3 * np.abs(np.concatenate([lo, hi])).max()
    assert (k_lo[coded] >= lo[coded] - tol).all() and (top[coded] <= hi[coded] + tol).all()
    narrowed = (top - k_lo)[coded] < 0.9 * (hi - lo)[coded]
    assert narrowed.any() if bits <= 3 else not narrowed.any()


def test_bits_follow_query_energy_times_key_range():
    """Channel 0 has a wide key range and large query components, channel 1 the same key range but
    no query energy, the rest narrow: channel 0 gets the most bits, channel 1 fewer than channel 0
    (its error is invisible to these queries), and the allocation is per head."""
    scale = np.ones(D, np.float32)
    scale[:2] = 8.0
    qs = np.ones(D, np.float32)
    qs[0], qs[1] = 6.0, 0.0
    c = make(n_calib=32)
    q = mx.random.normal((1, 2 * H, 64, D), key=mx.random.key(5)) * mx.array(qs)
    feed(c, rows(64, scale), rows(64, seed=1), queries=q)
    w = np.array(c.k_bits[0, :, 0])
    assert (w.sum(axis=1) == 4 * D).all()
    assert (w[:, 0] == w.max(axis=1)).all() and (w[:, 0] > w[:, 1]).all() and (w[:, 0] > 4).all()


def test_pre_rope_keys_quantize_far_better_than_post_rope():
    """Keys that are one fixed vector (plus small noise) rotated by RoPE: before RoPE every channel's
    range is tiny, after it the rotating pairs sweep their whole circle. Bound to the layer's RoPE,
    the cache quantizes the former: its key error is many times smaller."""
    rope = nn.RoPE(D, traditional=True, base=10000.0)
    base = mx.random.normal((1, H, 1, D), key=mx.random.key(3)) * 3
    pre = base + 0.01 * mx.random.normal((1, H, 200, D), key=mx.random.key(4))
    post = rope(pre)  # positions 0..199
    v = rows(200, seed=9)
    errs = {}
    for name, r in (("pre", rope), ("post", None)):
        c = make(bits=3, rope=r)
        feed(c, post, v)
        n = c.n_sink + c.n_quant
        K, _ = c._dense()
        errs[name] = float(mx.mean((K[:, :, 4:n] - post[:, :, 4:n]) ** 2))
    assert errs["pre"] * 50 < errs["post"], errs


def test_for_model_binds_the_layer_rope():
    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="waterfill", bit_width_inlier=4))
    spec = rope_spec(model.model.layers[0].self_attn.rope)
    assert spec is not None and all(c.rope == spec for c in caches)


def test_quantized_rows_cost_their_bit_budget_and_values_meet_the_lloyd_max_distortion():
    c = make(bits=4, residual_length=16)
    k, v = rows(400), rows(400, seed=1)
    feed(c, k, v)
    assert c.calibrated
    n = c.n_quant
    per_row = c.k_words[:, :, :n].nbytes + c.v_words[:, :, :n].nbytes + c.v_scales[:, :, :n].nbytes
    assert per_row == n * H * c.bytes_per_token() == n * H * (4 * D // 8 + 4 * D // 8 + 2)
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    assert c.used_nbytes <= c.nbytes <= c.used_nbytes * 1.1 + c.constant_nbytes + 2 * 2 * H * 32 * D
    # values: per row, the rotated coordinates over their RMS are coded with the 4-bit Lloyd-Max codebook
    # of N(0, 1); for Gaussian rows the mean squared error per coordinate is that codebook's distortion
    _, V = c._dense()
    s = c.sink_k.shape[2]
    y = v[:, :, s : s + n] @ value_rotation(D, c.seed)
    rms = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True))
    err = ((V[:, :, s : s + n] - v[:, :, s : s + n]) @ value_rotation(D, c.seed)) / rms
    assert float(mx.mean(err * err)) == pytest.approx(lloyd_max_distortion(4), rel=0.15)
    assert float(mx.mean(err * err)) < 0.8 * lloyd_max_distortion(3)  # not a coarser codebook


def test_compressed_attention_equals_dense_attention_over_the_stored_rows():
    c = make(n_calib=32)
    q = mx.random.normal((1, 2 * H, 100, D), key=mx.random.key(2))
    feed(c, rows(100), rows(100, seed=1), queries=q)
    for i in range(20):
        k, v, q = rows(1, seed=10 + i), rows(1, seed=50 + i), mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(i))
        K, V = c.update_and_fetch(k, v)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=None)
        # float32 on the CPU; GPU matmuls may round float32 inputs (TF32): measured 2.3e-4 on an H200
        assert float(mx.abs(out - ref).max()) < (1e-4 if mx.default_device() == mx.cpu else 1e-3)


def test_long_cpu_decode_step_decodes_its_rows_in_parts_on_cpu_streams(monkeypatch, op_path):
    """Past ``CPU_SPLIT_MIN_ROWS`` quantized rows a CPU decode step decodes its keys and values in ``CPU_STREAMS``
    contiguous row ranges (each on its own stream: MLX runs a CPU stream on one thread) and gets the stored rows'
    attention, as the one-part step does; below the threshold it stays one part (the op path: the CPU kernel,
    where built, takes these steps)."""
    from veloxquant_mlx.cache import attention

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the split is the CPU backend's")
    monkeypatch.setattr(attention, "CPU_SPLIT_MIN_ROWS", 128)
    c = make(n_calib=32, rope=nn.RoPE(D, traditional=False, base=1e4))
    feed(c, rows(100), rows(100, seed=1), queries=mx.random.normal((1, 2 * H, 100, D), key=mx.random.key(2)))
    seen = {"keys": [], "values": []}
    real_k, real_v = WaterfillKVCache._key_scores, WaterfillKVCache._weighted_values
    monkeypatch.setattr(WaterfillKVCache, "_key_scores", lambda s, q, a, b: seen["keys"].append((a, b))
                        or real_k(s, q, a, b))
    monkeypatch.setattr(WaterfillKVCache, "_weighted_values", lambda s, p, a, b: seen["values"].append((a, b))
                        or real_v(s, p, a, b))
    q, k1, v1 = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
                 enumerate([(1, 2 * H, 1, D), (1, H, 1, D), (1, H, 1, D)]))
    outs = {}
    for streams, total in [(2, 100), (2, 200), (1, 200)]:  # below the threshold, split, one part
        monkeypatch.setattr(attention, "CPU_STREAMS", streams)
        if c.stored_rows() < total:
            feed(c, rows(total - c.stored_rows(), seed=3), rows(total - c.stored_rows(), seed=4))
        for key in seen:
            seen[key].clear()
        K, V = c.update_and_fetch(k1, v1)
        got = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        want = mx.fast.scaled_dot_product_attention(q, K, V, scale=D**-0.5, mask=None)
        c.trim(1)
        n = c.n_quant
        cuts = [(0, n // 2), (n // 2, n)] if (streams, total) == (2, 200) else [(0, n)]
        assert (n >= 128) == (len(cuts) == 2 or streams == 1), n
        assert seen == {"keys": cuts, "values": cuts}, (streams, total, seen)
        assert float(mx.abs(got - want).max()) <= 1e-4 * float(mx.abs(want).max()), (streams, total)
        outs[streams, total] = got
    assert float(mx.abs(outs[2, 200] - outs[1, 200]).max()) <= 1e-5 * float(mx.abs(outs[1, 200]).max())


@pytest.mark.parametrize("method", ["waterfill", "kivi", "gear"])
def test_a_split_cpu_step_in_another_thread_equals_the_main_threads(monkeypatch, method):
    """MLX 0.32's streams belong to the thread that made them: a split decode step in a server's generation thread
    makes its own helper stream (it raised "There is no Stream(cpu, 1) in current thread" when the main thread's
    was reused) and gives the main thread's outputs."""
    import threading

    from veloxquant_mlx.cache import attention

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the split is the CPU backend's")
    for name, value in (("CPU_STREAMS", 2), ("CPU_SPLIT_MIN_ROWS", 64), ("CPU_SPLIT_DECODE_MIN_ROWS", 64)):
        monkeypatch.setattr(attention, name, value)
    k, v = rows(300), rows(300, seed=1)
    q = mx.random.normal((1, 2 * H, 300, D), key=mx.random.key(2))

    def decode():
        c = make(n_calib=32, rope=nn.RoPE(D, traditional=False, base=1e4)) if method == "waterfill" else \
            KVCacheFactory.create(KVCacheConfig(method=method, bit_width_inlier=4, head_dim=D))
        feed(c, k[:, :, :290], v[:, :, :290], queries=q[:, :, :290])
        outs = [feed(c, k[:, :, i : i + 1], v[:, :, i : i + 1], queries=q[:, :, i : i + 1]) for i in range(290, 300)]
        return np.array(mx.concatenate(outs, axis=2))  # evaluated here: a lazy array is its thread's

    main, got = decode(), []
    worker = threading.Thread(target=lambda: got.append(decode()))
    worker.start()
    worker.join()
    assert len(got) == 1 and np.abs(got[0] - main).max() <= 1e-5 * np.abs(main).max()


def test_without_queries_calibrates_with_equal_weights_at_the_next_call():
    c = make(n_calib=32)
    c.update_and_fetch(rows(40), rows(40, seed=1))  # no dispatch point: attend never runs
    assert not c.calibrated
    c.update_and_fetch(rows(1, seed=2), rows(1, seed=3))
    assert c.calibrated and c.saliency_source == "uniform" and c.n_quant > 0


@pytest.mark.parametrize("field,kw", [("bit_width_inlier", {"bit_width_inlier": 0}),
                                      ("bit_width_inlier", {"bit_width_inlier": 9}),
                                      ("n_calib_tokens", {"n_calib_tokens": 0})])
def test_bad_settings_name_their_field(field, kw):
    """(The window's flat field points to the method's options class.)"""
    with pytest.warns(DeprecationWarning, match=r"WaterfillOptions\(residual_length=\.\.\.\)"):
        KVCacheConfig(method="waterfill", residual_length=16)
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheFactory.create(KVCacheConfig(method="waterfill", **kw))
    assert e.value.field == field
