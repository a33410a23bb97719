"""TurboQuant-RVQ (the default method): data-oblivious two-stage residual VQ codebooks (distortion vs
the 4^-b bound, monotone in bits, the residual stage helps), packed storage and honest bytes,
attention on the codes equal to dense attention over the dequantized cache, and the mlx_lm contract
(generation on tiny llama/qwen2/gemma3, state files, deepcopy, trim, merge)."""

from __future__ import annotations

import copy
import math

import pytest

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from tiny_models import ARCHS, VOCAB, greedy, tiny_llama
from veloxquant_mlx.cache import (
    BatchingNotSupported,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    QuantizerConfigError,
    TurboQuantRVQOptions,
    dispatch,
)
from veloxquant_mlx.cache.artifacts import InMemoryArtifactStore
from veloxquant_mlx.cache.dispatch import dispatched_sdpa
from veloxquant_mlx.cache.methods.quantization import turboquant_rvq as tq
from veloxquant_mlx.cache.primitives import rvq  # the codebooks' LUT policy
from veloxquant_mlx.cache.primitives.rotation import seeded_rng

TQ_UPPER = math.sqrt(3) * math.pi / 2  # TurboQuant's distortion constant (~2.72)


def cfg(head_dim=16, dtype=None, store=None, **opts):
    return KVCacheConfig(head_dim=head_dim, dtype=dtype, store=store, options=TurboQuantRVQOptions(**opts))


def make(head_dim=16, **opts) -> tq.TurboQuantRVQKVCache:
    c = KVCacheFactory.create(cfg(head_dim, **opts))
    assert isinstance(c, tq.TurboQuantRVQKVCache)
    return c


def unit_samples(n, d, seed=123):
    g = seeded_rng(0x5EED, seed).standard_normal((n, d))
    return mx.array((g / np.linalg.norm(g, axis=1, keepdims=True)).astype(np.float32))


def mse_per_vector(cb, y, stage1_only=False):
    i, j = cb.encode(y)
    yh = cb.decode(i, None if stage1_only else j) if not stage1_only else mx.take(
        cb.c1, i.astype(mx.int32), axis=0).reshape(y.shape)
    return float(mx.sum((y - yh) ** 2, axis=-1).mean())


def layer_call(cache, q, k, v, scale, mask=None, sinks=None):
    """An mlx_lm attention layer: mask first, then update, then the (dispatched) sdpa; also returns
    dense attention over the rows update_and_fetch returned (the reference)."""
    mask = cache.make_mask(q.shape[2]) if mask is None else mask
    K, V = cache.update_and_fetch(k, v)
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask, sinks=sinks)
    out = dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return out, ref, K, V


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(11)


# ------------------------------------------------------------------------------------------ codebooks
def test_default_method_and_fields():
    c = KVCacheFactory.create(KVCacheConfig(head_dim=64))
    assert KVCacheConfig().method == "turboquant_rvq" and type(c) is tq.TurboQuantRVQKVCache
    assert (c.key_sub_dim, c.key_bits, c.value_sub_dim, c.value_bits, c.residual_length) == (4, 12, 8, 8, 128)
    assert tq.split_bits(12) == (8, 4) and tq.split_bits(8) == (8, 0) and tq.split_bits(16) == (8, 8)
    # defaults: keys 12 bits / 4 coords + fp16 norm, values 8 bits / 8 coords + fp16 norm
    assert c.bits_per_coordinate(64) == (3.25, 1.25)
    assert c.bytes_per_token(64) == 26 + 10  # vs 256 at float16: 0.14x


@pytest.mark.parametrize("sub_dim, bits", [(4, 8), (8, 8), (4, 12)])
def test_codebook_distortion_is_within_turboquant_bound(sub_dim, bits):
    """MSE per unit vector of rotated unit vectors at b = bits/sub_dim bits per coordinate lies between
    the information-theoretic 4^-b and TurboQuant's sqrt(3)*pi/2 * 4^-b (measured on fresh samples)."""
    d = 64
    cb = tq.rvq_codebook(d, sub_dim, bits, 42)
    b = bits / sub_dim
    mse = mse_per_vector(cb, unit_samples(3000, d))
    assert 4.0**-b < mse < TQ_UPPER * 4.0**-b, (mse, mse * 4**b)
    if bits == 12:  # a vector quantizer beats the paper's scalar Lloyd-Max at the same rate (0.0334)
        from veloxquant_mlx.cache.primitives.codebook import lloyd_max_distortion

        assert mse < 0.95 * lloyd_max_distortion(3, d)


def test_error_decreases_with_codebook_bits_and_residual_stage_helps():
    d, s = 16, 4
    y = unit_samples(4000, d)
    errs = [mse_per_vector(tq.rvq_codebook(d, s, b, 42), y) for b in (4, 6, 8, 10, 12)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    # each extra bit per 4-dim sub-vector cuts the error by a sizeable factor (ideal 2^(2/4) per bit)
    assert errs[-1] < 0.25 * errs[0]
    cb = tq.rvq_codebook(d, s, 12, 42)
    one, two = mse_per_vector(cb, y, stage1_only=True), mse_per_vector(cb, y)
    assert two < 0.5 * one, (one, two)  # the 4-bit residual stage removes more than half the error


def test_codebooks_are_seeded_and_cached_in_the_artifact_store():
    store = InMemoryArtifactStore()
    c = KVCacheFactory.create(cfg(16, store=store))
    c.update_and_fetch(mx.random.normal((1, 2, 200, 16)), mx.random.normal((1, 2, 200, 16)))
    assert "tqrvq.d16.s4.b12.seed42" in store and "tqrvq.d16.s8.b8.seed42" in store
    cb = tq.rvq_codebook(16, 4, 12, 42)
    again = tq.RVQCodebook.from_array(store.get("tqrvq.d16.s4.b12.seed42"), 16, 4, 12)
    assert mx.array_equal(again.c1, cb.c1) and mx.array_equal(again.c2, cb.c2)
    assert not mx.array_equal(tq.rvq_codebook(16, 4, 8, 7).c1, tq.rvq_codebook(16, 4, 8, 42).c1)


# ------------------------------------------------------------------------------------------ storage
def test_codes_are_packed_at_their_real_width_and_bytes_match_the_budget():
    d, H, T = 64, 2, 1184  # T - R a whole number of QUANT_BLOCKs: the window is left at exactly R rows
    c = make(d)
    x = mx.random.normal((1, H, T, d))
    c.update_and_fetch(x, x * 0.5)
    R, S = c.residual_length, tq.SINK_ROWS
    assert c.n_quant == T - R - S and c.n_win == R and c.n_sink == S
    # 12-bit key codes: a plane of 16 x 8 bits (4 words) and one of 16 x 4 bits (2 words) per row;
    # 8-bit value codes: one plane of 8 x 8 bits (2 words); no stage-2 plane for values
    assert c.k_codes1.dtype == mx.uint32 and c.k_codes1.shape[-1] == 4 and c.k_codes2.shape[-1] == 2
    assert c.v_codes1.shape[-1] == 2 and "v_codes2" not in c.array_fields
    assert c.k_norms.dtype == mx.float16 and c.win_k.dtype == mx.float16
    per_token = c.bytes_per_token()
    assert per_token == 36 and per_token / (2 * d * 2) < 0.15
    window = H * (R + S) * 2 * d * 2  # float16 window and sink rows
    used_quant = c.used_nbytes - window
    assert used_quant == H * c.n_quant * per_token  # exactly the theoretical budget
    # nbytes: everything held (spare capacity of the growing buffers included) + shared constants once
    held = sum(getattr(c, n).nbytes for n in c.array_fields)
    assert c.nbytes == held + c.constant_nbytes and c.counts_constants
    held_quant = held - sum(getattr(c, n).nbytes for n in ("win_k", "win_v", "sink_k", "sink_v"))
    assert abs(held_quant / (H * c.n_quant) - per_token) <= 0.10 * per_token, held_quant / (H * c.n_quant)
    # constants: one 64x64 float32 rotation (keys and values share it), the key codebook with its
    # 4096 x 4 table of joint reconstructions, the value codebook: ~96 KB, once per model
    kcb, vcb = c._kq.cb, c._vq.cb
    assert c._kq.rot_t is c._vq.rot_t
    # also its transpose once a decode kernel (or a test of its pieces) made it, and 16-bit copies for GPU prefill
    made = {id(a): a for q in (c._kq, c._vq) for a in [q.back, *q.in_dtype.values()] if a is not None}
    back = sum(a.nbytes for a in made.values())
    assert c.constant_nbytes == 64 * 64 * 4 + back + kcb.nbytes + vcb.nbytes < 120 * 1024


def test_constants_are_counted_once_per_model():
    model = tiny_llama(n_layers=3)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig())
    model(mx.random.randint(0, VOCAB, (1, 50)), cache=caches)
    assert [c.counts_constants for c in caches] == [True, False, False]
    assert caches[0]._kq is caches[1]._kq  # one rotation/codebook object shared by the layers
    held = sum(sum(a.nbytes for a in c.held_arrays()) for c in caches)
    assert sum(c.nbytes for c in caches) == held + caches[0].constant_nbytes > held


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("opts, joint", [({}, True), ({}, False),
                                         ({"key_codebook_bits": 16, "value_sub_dim": 4, "value_codebook_bits": 16}, False),
                                         ({"key_codebook_bits": 6, "value_codebook_bits": 3}, True)])
@pytest.mark.parametrize("chunks", [[70, 1, 1, 1, 40, 1, 30, 1], [1] * 5 + [45] + [1] * 3])
@pytest.mark.parametrize("gpu_chunks", [False, True])
def test_attend_on_codes_equals_dense_attention_over_the_dequantized_cache(opts, joint, chunks, gpu_chunks,
                                                                           monkeypatch):
    """Decode steps use the LUT path (one joint table, or per-stage tables), prefill chunks after
    quantized rows the rotated-domain matmul (or, ``gpu_chunks``, the GPU's fused attention in the rotated
    domain: ``_rotated_chunk``); all equal mx.fast sdpa over what update_and_fetch returned (dequantized codes
    + float16 rows + the call's rows)."""
    monkeypatch.setattr(rvq, "JOINT_LUT_PER_TOKEN", 10**6 if joint else 0)
    if gpu_chunks:
        _rotated_chunks(monkeypatch)
    dispatch.install()
    B, Hq, H, D = 2, 6, 2, 16
    c = make(D, residual_length=8, **opts)
    seen_lut = seen_quant = False
    for n in chunks:
        q = mx.random.normal((B, Hq, n, D))
        k, v = mx.random.normal((B, H, n, D)) * 2, mx.random.normal((B, H, n, D))
        quant_before = c.n_quant
        out, ref, K, _ = layer_call(c, q, k, v, scale=D**-0.5)
        assert K.shape[2] == c.offset
        assert out.shape == ref.shape and float(mx.abs(out - ref).max()) < 1e-4, n
        seen_quant |= quant_before > 0
        seen_lut |= quant_before > 0 and 3 * n <= tq.LUT_MAX_ROWS
    assert seen_quant and seen_lut and c.n_quant > 0


def test_long_cpu_decode_step_decodes_the_values_on_a_second_stream(monkeypatch, op_path):
    """Past ``CPU_SPLIT_DECODE_MIN_ROWS`` quantized rows (two CPU streams) a CPU decode step decodes the values'
    codewords on a second stream while the current one scores the keys (MLX runs a CPU stream on one thread);
    below it on the current one; the attention equals dense attention over the returned rows either way."""
    from veloxquant_mlx.cache import attention

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the split is the CPU backend's")
    monkeypatch.setattr(attention, "CPU_STREAMS", 2)
    monkeypatch.setattr(attention, "CPU_SPLIT_DECODE_MIN_ROWS", 128)
    streams, real = [], tq._Quantizer.decode_rotated
    monkeypatch.setattr(tq._Quantizer, "decode_rotated", lambda s, *a: streams.append(mx.default_stream(mx.cpu))
                        or real(s, *a))
    dispatch.install()
    c, main = make(16, residual_length=8), mx.default_stream(mx.cpu)
    for n in (100, 100):  # ~88 quantized rows, then ~188
        layer_call(c, mx.random.normal((1, 4, n, 16)), mx.random.normal((1, 2, n, 16)),
                   mx.random.normal((1, 2, n, 16)), scale=0.25)
        q, k, v = (mx.random.normal((1, h, 1, 16)) for h in (4, 2, 2))
        K, V = c.update_and_fetch(k, v)
        streams.clear()  # the returned rows' decoding (lazy, never evaluated) is not the attention's
        out = dispatched_sdpa(q, K, V, cache=c, scale=0.25, mask=None)
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.25, mask=None)
        assert streams == [main] if c.n_quant < 128 else (len(streams) == 1 and streams[0] != main), c.n_quant
        assert float(mx.abs(out - ref).max()) <= 1e-4 * float(mx.abs(ref).max()), c.n_quant
    assert c.n_quant >= 128


def _rotated_chunks(monkeypatch):
    """Every chunk a GPU would send to ``_rotated_chunk`` goes there on this machine too."""
    monkeypatch.setattr(tq.TurboQuantRVQKVCache, "_attend_chunk",
                        lambda self, q, k, v, call, *, scale, mask, sinks, tile=None:
                        self._rotated_chunk(q, call, scale=scale, mask=mask, sinks=sinks))


@pytest.mark.parametrize("gpu_chunks", [False, True])
def test_attend_honours_array_masks_and_sinks(gpu_chunks, monkeypatch):
    if gpu_chunks:
        _rotated_chunks(monkeypatch)
    dispatch.install()
    B, Hq, H, D = 1, 4, 2, 16
    sinks = mx.random.normal((Hq,))
    c = make(D, residual_length=8)
    layer_call(c, mx.random.normal((B, Hq, 5, D)), mx.random.normal((B, H, 5, D)),
               mx.random.normal((B, H, 5, D)), scale=0.25)
    mask = mx.random.uniform(shape=(B, Hq, 2, 7)) > 0.3  # window rows only (nothing quantized yet)
    mask[..., -1] = True
    out, ref, _, _ = layer_call(c, mx.random.normal((B, Hq, 2, D)), mx.random.normal((B, H, 2, D)),
                                mx.random.normal((B, H, 2, D)), scale=0.25, mask=mask, sinks=sinks)
    assert float(mx.abs(out - ref).max()) < 1e-4
    layer_call(c, mx.random.normal((B, Hq, 53, D)), mx.random.normal((B, H, 53, D)),
               mx.random.normal((B, H, 53, D)), scale=0.25)
    for n in (1, 3):
        mask = mx.random.uniform(shape=(B, Hq, n, c.stored_rows() + n)) > 0.3
        mask[..., -1] = True
        q = mx.random.normal((B, Hq, n, D))
        out, ref, _, _ = layer_call(c, q, mx.random.normal((B, H, n, D)), mx.random.normal((B, H, n, D)),
                                    scale=0.25, mask=mask, sinks=sinks)
        assert float(mx.abs(out - ref).max()) < 1e-4


def test_dense_path_without_dispatch_returns_stored_rows_then_new_rows():
    dispatch.uninstall()
    B, H, D = 1, 2, 16
    c = make(D, residual_length=8)
    x = mx.random.normal((B, H, 50, D))
    K, V = c.update_and_fetch(x, x)
    assert mx.array_equal(K, x)  # the call's own rows as given (prefill is exact)
    new = mx.random.normal((B, H, 1, D))
    K, V = c.update_and_fetch(new, new)
    S, q0 = tq.SINK_ROWS, 50 - 8
    f16 = lambda a: a.astype(mx.float16).astype(mx.float32)
    assert K.shape == (B, H, 51, D) and mx.array_equal(K[:, :, -1:], new)
    assert mx.array_equal(K[:, :, q0:50], f16(x[:, :, q0:]))  # window
    assert mx.array_equal(K[:, :, :S], f16(x[:, :, :S]))  # sink rows
    rel = mx.sqrt(mx.sum((K[:, :, S:q0] - x[:, :, S:q0]) ** 2, -1) / mx.sum(x[:, :, S:q0] ** 2, -1))
    assert float(rel.mean()) < 0.5 and float(rel.max()) < 0.9  # codes: 5 bits/coord for 16-dim heads
    K2, V2 = c._dense()  # the stored form
    assert K2.shape[2] == 51 and mx.array_equal(K2[:, :, :q0], K[:, :, :q0])


# ------------------------------------------------------------------------------------------ mlx_lm contract
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generation_through_mlx_lm_default_config(arch):
    """for_model with KVCacheConfig() (the default method) inside mlx_lm's generate_step, a prompt
    longer than one prefill chunk: a window that holds everything is lossless (float32 window), and
    a small window quantizes (and still generates)."""
    model = ARCHS[arch]()
    prompt = mx.random.randint(0, VOCAB, (45,)).tolist()
    ref = greedy(model, prompt, make_prompt_cache(model), 8, prefill_step_size=16)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(dtype=mx.float32))
    assert greedy(model, prompt, caches, 8, prefill_step_size=16) == ref
    assert any(type(c) is tq.TurboQuantRVQKVCache for c in caches)
    plain_default = KVCacheBuilder.for_model(model, KVCacheConfig())  # float16 window
    assert len(greedy(model, prompt, plain_default, 8, prefill_step_size=16)) == 8
    small = KVCacheBuilder.for_model(model, KVCacheConfig(options=TurboQuantRVQOptions(residual_length=4)))
    out = greedy(model, prompt, small, 8, prefill_step_size=16)
    ours = [c for c in small if type(c) is tq.TurboQuantRVQKVCache]
    assert len(out) == 8 and all(c.n_quant > 0 and c.offset == 45 + 8 for c in ours)  # one step ahead


def test_single_token_first_calls_and_batches():
    model = tiny_llama()
    toks = mx.random.randint(0, VOCAB, (2, 50))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(options=TurboQuantRVQOptions(residual_length=8)))
    outs = [model(toks[:, i : i + 1], cache=caches) for i in range(50)]
    ref = model(toks, cache=make_prompt_cache(model))
    got = mx.concatenate(outs, axis=1)
    assert caches[0].n_quant > 0 and bool(mx.all(mx.isfinite(got)))
    # the first R + QUANT_BLOCK - 1 steps see only float16 rows: nearly exact
    assert float(mx.abs(got[:, :39] - ref[:, :39]).max()) < 5e-2


def test_state_round_trip_through_prompt_cache_files(tmp_path):
    model = tiny_llama()
    toks = mx.random.randint(0, VOCAB, (1, 90))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(options=TurboQuantRVQOptions(residual_length=16, key_codebook_bits=10)))
    model(toks, cache=caches)
    model(mx.array([[4]]), cache=caches)
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    a, b = loaded[0], caches[0]
    assert (a.offset, a.n_sink, a.n_quant, a.n_win, a.key_bits, a.residual_length) == \
        (b.offset, b.n_sink, b.n_quant, b.n_win, 10, 16)
    assert [c.counts_constants for c in loaded] == [True, False, False]
    assert a.used_nbytes == b.used_nbytes and a.nbytes <= b.nbytes  # only used rows are saved
    nxt = mx.array([[3]])
    assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=loaded))
    for _ in range(40):  # both keep compacting identically
        assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=loaded))


def test_deepcopy_is_independent_and_shares_constants():
    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(options=TurboQuantRVQOptions(residual_length=8)))
    model(mx.random.randint(0, VOCAB, (1, 60)), cache=caches)
    twin = copy.deepcopy(caches)
    assert twin[0]._kq is caches[0]._kq and twin[0].k_codes1 is not caches[0].k_codes1
    a = model(mx.array([[5]]), cache=caches)
    b = model(mx.array([[5]]), cache=twin)
    assert mx.array_equal(a, b)
    model(mx.array([[6]]), cache=caches)
    assert twin[0].offset == 61 and caches[0].offset == 62


def test_trim_is_exact_in_the_window_and_honest_beyond_it():
    model = tiny_llama()
    toks = mx.random.randint(0, VOCAB, (1, 70))
    opts = TurboQuantRVQOptions(residual_length=16)

    def fresh(n):
        cs = KVCacheBuilder.for_model(model, KVCacheConfig(options=opts))
        model(toks[:, :n], cache=cs)
        return cs

    caches = fresh(60)
    for t in range(3):
        model(toks[:, 60 + t : 61 + t], cache=caches)
    assert all(c.is_trimmable() for c in caches)
    assert caches[0].n_win >= 3 and [c.trim(3) for c in caches] == [3] * 3 and caches[0].offset == 60
    nxt = toks[:, 60:61]
    assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=fresh(60)))  # exact
    # beyond the window: the newest codes are dropped, the rest keep theirs (never raises)
    c = caches[0]
    n_win, n_quant = c.n_win, c.n_quant
    assert [x.trim(n_win + 10) for x in caches] == [n_win + 10] * 3
    assert (c.n_win, c.n_quant, c.offset) == (0, n_quant - 10, 61 - n_win - 10)
    dispatch.install()
    q = mx.random.normal((1, 4, 1, 16))
    out, ref, K, _ = layer_call(c, q, mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 1, 16)), 0.25)
    assert K.shape[2] == c.offset and float(mx.abs(out - ref).max()) < 1e-4


def test_trim_into_sink_rows_then_refill_after_a_state_round_trip():
    """Trimming down to 2 stored tokens leaves 2 float16 sink rows; a restored copy (state holds
    only used rows) refills the sinks in position order and still attends exactly on its rows."""
    dispatch.install()
    B, Hq, H, D = 1, 4, 2, 16
    c = make(D, residual_length=8)
    x = mx.random.normal((B, H, 60, D))
    layer_call(c, mx.random.normal((B, Hq, 40, D)), x[:, :, :40], x[:, :, :40], 0.25)
    assert (c.n_sink, c.n_win) == (tq.SINK_ROWS, 8) and c.n_quant == 28
    assert c.trim(38) == 38 and (c.n_sink, c.n_quant, c.n_win, c.offset) == (2, 0, 0, 2)
    c2 = tq.TurboQuantRVQKVCache.from_state(c.state)
    assert c2.sink_k.shape[2] == 2 and c2.key_bits == 12
    out, ref, K, _ = layer_call(c2, mx.random.normal((B, Hq, 40, D)), x[:, :, 20:60], x[:, :, 20:60], 0.25)
    assert (c2.n_sink, c2.offset) == (tq.SINK_ROWS, 42) and float(mx.abs(out - ref).max()) < 1e-4
    K2, _ = c2._dense()
    f16 = lambda a: a.astype(mx.float16).astype(mx.float32)
    assert mx.array_equal(K2[:, :, :2], f16(x[:, :, :2])) and mx.array_equal(K2[:, :, 2:4], f16(x[:, :, 20:22]))
    q = mx.random.normal((B, Hq, 1, D))
    out, ref, _, _ = layer_call(c2, q, x[:, :, :1], x[:, :, :1], 0.25)
    assert float(mx.abs(out - ref).max()) < 1e-4


def test_merge_builds_the_batch_form_and_bad_configs_are_rejected():
    """merge builds the compressed batch form (tests/test_turboquant_rvq_batch.py); a subclass refuses."""
    from veloxquant_mlx.cache.methods.quantization.turboquant_rvq_batch import TurboQuantRVQBatchKVCache

    assert type(tq.TurboQuantRVQKVCache.merge([make(), make()])) is TurboQuantRVQBatchKVCache

    class Sub(tq.TurboQuantRVQKVCache):
        pass

    with pytest.raises(BatchingNotSupported):
        Sub.merge([Sub(cfg()), Sub(cfg())])
    with pytest.raises(QuantizerConfigError, match="key_sub_dim"):
        make(16, key_sub_dim=3)
    c = make(16)
    with pytest.raises(QuantizerConfigError, match="value_sub_dim"):
        c.update_and_fetch(mx.zeros((1, 1, 2, 16)), mx.zeros((1, 1, 2, 12)))


# ------------------------------------------------------------------------------------------ real model
@pytest.mark.real_model
def test_default_config_on_the_embedded_model_kl_and_bytes():
    """SmolLM2-135M, 1024-token essay prompt, 64 decode steps: measured KLD 0.066 at the defaults with
    0.141x fp16 bytes per quantized token and 0.282x for the whole cache (window included)."""
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.eval.fidelity import next_token_fidelity
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    ids = tok.encode(essays_text(max_chars=40_000), add_special_tokens=False)[:1088]
    r = next_token_fidelity(model, ids, 1024, 64, KVCacheConfig(head_dim=64))
    print(f"\nturboquant_rvq defaults: KLD {r.kld:.4f}, top-1 {r.top1_agree:.3f}, whole cache {r.compression:.3f}x fp16")
    assert r.kld < 0.08 and r.top1_agree > 0.75
    assert r.compression < 0.30
