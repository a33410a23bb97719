"""Decode attention on the compressed forms (one query row).

On the CPU (CI): the pieces of the fused kernels' path against float64 references -- the merge of
split-K partials with the exact rows, the query-side RoPE identity the waterfill kernel uses, the
bit addressing both kernels read (against the layouts' own unpacking), waterfill's transform
rotation -- and the op path's decode step against float64 attention over the stored rows (random
shapes, odd lengths, GQA ratios, window/sink and group boundaries). Where MLX's CUDA backend is
present (not in CI), each kernel against the op path on the same caches."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch, native
from veloxquant_mlx.cache.kernels import _common, _compile, kernels_enabled, merge_partials, split_count
from veloxquant_mlx.cache.kernels import kivi as kivi_kernel
from veloxquant_mlx.cache.kernels import kivi_rows, kvquant_rows, turboquant_rvq_rows as tq_rows
from veloxquant_mlx.cache.kernels.kvquant_rows import outliers_by_entry as _by_entry
from veloxquant_mlx.cache.kernels import turboquant_rvq as tq_kernel
from veloxquant_mlx.cache.kernels import waterfill as wf_kernel
from veloxquant_mlx.cache.kernels import waterfill_rows as wf_rows
from veloxquant_mlx.cache.methods.quantization.kivi import KIVIKVCache
from veloxquant_mlx.cache.methods.quantization.kivi_sink import KIVISinkKVCache
from veloxquant_mlx.cache.methods.quantization.turboquant_rvq import ResidualWindowCache, TurboQuantRVQKVCache
from veloxquant_mlx.cache.methods.quantization.turboquant_rvq_batch import TurboQuantRVQBatchKVCache
from veloxquant_mlx.cache.methods.quantization.waterfill import WaterfillKVCache
from veloxquant_mlx.cache.methods.quantization.waterfill import rotate_values, value_rotation
from veloxquant_mlx.cache.options import KIVIOptions, KIVISinkOptions, KVQuantOptions, TurboQuantRVQOptions
from veloxquant_mlx.cache.primitives import blocks, groupquant as gq
from veloxquant_mlx.cache.primitives.bitpack import pack_bits, unpack_bits
from veloxquant_mlx.cache.primitives.codebook import odd_poly_gaussian
from veloxquant_mlx.cache.primitives.rope import apply_rope, rope_spec
from veloxquant_mlx.cache.primitives.rvq import rvq_codebook
from veloxquant_mlx.cache.primitives.varpack import VarLayout
from veloxquant_mlx.cache.window import softmax_exp

from test_waterfill import make as make_waterfill  # noqa: E402

GPU = pytest.mark.skipif(not kernels_enabled(), reason="the decode kernels need MLX's CUDA backend (none here)")
# float32 against float64: on the CPU float32 rounding; GPU matmuls may round float32 inputs (TF32:
# relative ~3e-4 measured on an H200)
TOL32 = 1e-5 if mx.default_device() == mx.cpu else 3e-3
TOL_ATTN = 1e-4 if mx.default_device() == mx.cpu else 3e-3


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _softmax_attention64(q, k, v, scale, sinks=None):
    """float64 reference: q [B, Hq, 1, D], k/v [B, H, M, D] (GQA), sinks [Hq] logits or None."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, N, D = q.shape
    H = k.shape[1]
    qg = q.reshape(B, H, Hq // H, N, D)
    s = np.einsum("bhrnd,bhmd->bhrnm", qg, k) * scale
    peak = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sk = np.asarray(sinks, np.float64).reshape(1, H, Hq // H, 1, 1)
        peak = np.maximum(peak, sk)
    p = np.exp(s - peak)
    den = p.sum(axis=-1, keepdims=True) + (np.exp(sk - peak) if sinks is not None else 0.0)
    out = np.einsum("bhrnm,bhmd->bhrnd", p, v) / den
    return out.reshape(B, Hq, N, v.shape[-1])


# ---------------------------------------------------------------------------------------- merge
@pytest.mark.parametrize("seed,B,H,R,splits,E,with_sinks", [
    (0, 1, 2, 1, 1, 1, False), (1, 1, 3, 3, 5, 17, True), (2, 2, 2, 4, 7, 1, False), (3, 1, 1, 8, 3, 30, True)])
def test_merge_partials_is_one_softmax_over_all_rows(seed, B, H, R, splits, E, with_sinks):
    """Split-K partials of the quantized rows (values in a rotated domain; one split left empty, as a
    kernel's last split can be), the exact rows' partial last, and sink logits: the merge equals one
    float64 softmax over every row."""
    rng = np.random.default_rng(seed)
    DV = 32
    n = 7 * splits - 3
    sq = rng.normal(size=(B, H, R, n)) * 3
    vq_rot = rng.normal(size=(B, H, n, DV))
    rot = np.linalg.qr(rng.normal(size=(DV, DV)))[0]
    se, ev = rng.normal(size=(B, H, R, E)) * 3, rng.normal(size=(B, H, E, DV))
    sinks = rng.normal(size=(H * R,)) if with_sinks else None
    per = -(-n // splits)
    S = splits + 1  # the last quantized split is empty
    m = np.full((B, H, R, S + 1), -np.inf)
    l = np.zeros((B, H, R, S + 1))
    acc = np.zeros((B, H, R, S + 1, DV))

    def put(s, scores, vals):
        m[..., s] = scores.max(axis=-1)
        p = np.exp(scores - m[..., s, None])
        l[..., s] = p.sum(axis=-1)
        acc[..., s, :] = np.einsum("bhrt,bhtd->bhrd", p, vals)

    for s in range(S):
        a, b = min(n, s * per), min(n, (s + 1) * per)
        if b > a:
            put(s, sq[..., a:b], vq_rot[:, :, a:b])
    put(S, se, ev)
    f32 = lambda x: mx.array(np.asarray(x, np.float32))  # noqa: E731
    got = merge_partials(f32(m), f32(l), f32(acc), None if sinks is None else f32(sinks),
                         rotate=lambda y: y @ f32(rot.T))
    s_all = np.concatenate([sq, se], axis=-1)
    v_all = np.concatenate([vq_rot @ rot.T, ev], axis=2)
    peak = s_all.max(axis=-1, keepdims=True)
    if sinks is not None:
        peak = np.maximum(peak, sinks.reshape(1, H, R, 1))
    p = np.exp(s_all - peak)
    den = p.sum(axis=-1) + (np.exp(sinks.reshape(1, H, R) - peak[..., 0]) if sinks is not None else 0)
    want = np.einsum("bhrm,bhmd->bhrd", p, v_all) / den[..., None]
    assert got.shape == (B, H, R, DV)
    assert _rel(got, want) < TOL32


@GPU
@pytest.mark.parametrize("S1,B,H,R,DV,sinks,hadamard", [
    (2, 1, 2, 1, 128, False, False), (9, 2, 2, 4, 64, True, True), (33, 1, 8, 4, 128, False, True),
    (129, 1, 3, 2, 128, True, False), (513, 2, 1, 3, 32, False, True), (260, 1, 2, 1, 256, True, True)])
def test_merge_kernel_equals_merge_partials(S1, B, H, R, DV, sinks, hadamard):
    """The merge kernel (its threads summing the splits in parallel parts, the Walsh-Hadamard rotation in shared
    memory) equals the op-path merge on random partials with empty splits, from 2 to 513 splits."""
    rng = np.random.default_rng(S1)
    m = rng.normal(size=(B, H, R, S1)) * 4
    m[..., rng.random(S1) < 0.2] = -np.inf  # empty splits
    m[..., -1] = rng.normal(size=(B, H, R))  # the exact rows' partial is never empty
    l = np.where(np.isfinite(m), rng.uniform(0.5, 30, size=m.shape), 0.0)
    acc = rng.normal(size=(B, H, R, S1, DV)) * l[..., None]
    f32 = lambda x: mx.array(np.asarray(x, np.float32))  # noqa: E731
    sk = f32(rng.normal(size=(H * R,)) * 3) if sinks else None
    got = _common.merge_kernel(f32(m), f32(l), f32(acc), sk, hadamard, mx.float32)
    want = merge_partials(f32(m), f32(l), f32(acc), sk,
                          rotate=(lambda y: rotate_values(y, 0, inverse=True)) if hadamard else None)
    assert got.shape == (B, H * R, 1, DV)
    assert _rel(got.reshape(B, H, R, DV), want) < 1e-5


def test_merge_kernel_refuses_more_partials_than_its_shared_table_holds():
    S1 = _common.MAX_SPLITS + 2
    m, l = mx.zeros((1, 1, 1, S1)), mx.ones((1, 1, 1, S1))
    with pytest.raises(ValueError, match="MAX_SPLITS"):
        _common.merge_kernel(m, l, mx.zeros((1, 1, 1, S1, 32)), None, False, mx.float32)


def test_checked_call_raises_the_op_paths_error_and_keeps_the_kernel(monkeypatch):
    """A first-use check whose op path raises (arrays inconsistent with each other: a corrupt or forged saved cache)
    raises that error and leaves the kernel on; a kernel that fails to build is turned off with one warning and the
    op path's result returned. The cache's record of the step is restored for the second function either way."""
    monkeypatch.setattr(_common, "_checked", set())
    monkeypatch.setattr(_common, "_disabled", set())
    owner = type("Owner", (), {"_call": "record"})()
    seen = []

    def corrupt():
        seen.append(owner._call)
        raise ValueError("shapes disagree")

    with pytest.raises(ValueError, match="shapes disagree"):
        _common.checked_call("probe", owner, lambda: mx.ones(3), corrupt)
    assert seen == ["record"] and "probe" not in _common._disabled | _common._checked

    def no_build():
        owner._call = None
        raise RuntimeError("no launch")

    with pytest.warns(RuntimeWarning, match="'probe' failed"):
        out = _common.checked_call("probe", owner, no_build, lambda: mx.full(3, owner._call == "record", mx.float32))
    assert "probe" in _common._disabled and out.tolist() == [1.0] * 3


def test_split_count_grows_with_the_context_and_is_bounded():
    assert split_count(1) == 1 and split_count(256) == 1 and split_count(257) == 2
    assert split_count(32768) == 128 and split_count(10**7) == _common.MAX_SPLITS


# ---------------------------------------------------------------------------------------- RoPE on the query
@pytest.mark.parametrize("traditional,dims", [(False, 64), (True, 64), (False, 32), (True, 48)])
def test_query_side_rope_identity_matches_the_layer(traditional, dims):
    """``q . RoPE_t(k) = sum_c k_c (q_c cos(t w_c) + sign_c q_partner(c) sin(t w_c))`` with the tables the
    waterfill kernel reads, for full and partial rotary dims, at several positions."""
    D = 64
    spec = rope_spec(nn.RoPE(dims, traditional=traditional, base=10000.0))
    assert spec is not None
    w, partner, sign = (np.array(a) for a in wf_kernel.rope_tables(spec, D))
    rng = np.random.default_rng(dims + traditional)
    q, k = rng.normal(size=D), rng.normal(size=(1, 1, 1, D)).astype(np.float32)
    for t in (0, 1, 37, 1000):
        post = np.array(apply_rope(mx.array(k), spec, t), np.float64)[0, 0, 0]
        want = q @ post
        ang = t * w.astype(np.float64)
        got = np.sum(k[0, 0, 0].astype(np.float64) * (q * np.cos(ang) + sign * q[partner] * np.sin(ang)))
        assert abs(got - want) < 1e-4 * np.abs(q).sum() * np.abs(k).max()


def test_rope_tables_without_rope_leave_the_query_alone():
    w, partner, sign = (np.array(a) for a in wf_kernel.rope_tables(None, 32))
    assert not w.any() and not sign.any() and (partner == np.arange(32)).all()


def test_waterfill_kernel_groups_rows_and_heads_within_a_warp():
    """Each group reduces PF rows x RP2 query heads (RP2: the heads rounded up to a power of two) over 32 lanes, so
    their product is a power of two of at most 32 and PF as large as that allows (at most PREFETCH rows); value codes
    are decoded without shuffles only when they never straddle a word; RoPE pairs meet in a lane only for the
    half-split rotation over every channel, with d/2 a multiple of 32."""
    for rep in range(1, 33):
        g = dict(wf_kernel.group_constants(rep, 4, 128))
        nv = g["PF"] * g["RP2"]
        assert g["RP2"] >= rep and g["RP2"] < 2 * rep and nv <= 32 and nv == 1 << g["LNV"]
        assert g["RP2"] == 1 << g["LRP"] and g["PF"] == min(wf_kernel.PREFETCH, 32 // g["RP2"])
    assert [dict(wf_kernel.group_constants(4, b, 128))["VMAP"] for b in (1, 2, 3, 4, 5, 8)] == [
        True, True, False, True, False, True]
    assert not dict(wf_kernel.group_constants(4, 8, 256))["VMAP"]  # a lane's 8 channels would span two words
    spec = {"dims": 128, "traditional": False}
    assert wf_kernel.paired_rope(spec, 128) and wf_kernel.paired_rope(None, 64)
    assert not wf_kernel.paired_rope({**spec, "traditional": True}, 128)
    assert not wf_kernel.paired_rope({**spec, "dims": 64}, 128) and not wf_kernel.paired_rope(None, 32)
    # shared memory: 16 query heads per KV head at d 128, 32 at d 64; never more than 32 (one warp's lanes)
    assert wf_kernel.supported(128, 128, 16, 16, 16) and not wf_kernel.supported(128, 128, 16, 16, 32)
    assert wf_kernel.supported(64, 64, 8, 8, 32) and not wf_kernel.supported(64, 64, 8, 8, 33)


def test_waterfill_tensor_core_form_takes_paired_4bit_layouts_of_up_to_8_query_heads():
    """The mma form: rotary pairs split in halves (or no RoPE), head dims 64 or 128, 4-bit values, at most 8 query
    heads per KV head (the mma's n); everything else keeps the float32 kernel."""
    tc = wf_kernel.tensor_core_layout
    assert tc(128, 128, 4, 4, True) and tc(64, 64, 4, 8, True) and tc(128, 64, 4, 1, True)
    assert not tc(128, 128, 4, 4, False)  # traditional or partial rotation
    assert not tc(128, 128, 2, 4, True) and not tc(128, 128, 8, 4, True) and not tc(128, 128, 3, 4, True)
    assert not tc(128, 128, 4, 9, True) and not tc(256, 256, 4, 4, True) and not tc(96, 128, 4, 4, True)
    assert not wf_kernel.uses_tensor_cores(128, 128, 4, 4, True, mx.float32)  # float32 models: float32 kernel


@pytest.mark.parametrize("dims,traditional,D", [(128, False, 128), (64, False, 64), (None, False, 64)])
def test_rope_delta_table_holds_the_turn_of_each_row_offset(dims, traditional, D):
    """Entry [t, r] holds (cos, sin)(t w_c) as float16 pairs for channels (4 r, 4 r + 1), (4 r + 2, 4 r + 3) of the
    first rotary half, w_c the layer's angle per position (none without RoPE: cos 1, sin 0)."""
    spec = None if dims is None else rope_spec(nn.RoPE(dims, traditional=traditional, base=10000.0))
    tab = np.array(wf_kernel.rope_delta_table(spec, D))
    assert tab.shape == (64, D // 8, 4) and tab.dtype == np.uint32
    halves = np.stack([tab & 0xFFFF, tab >> 16], axis=-1).astype(np.uint16).view(np.float16).astype(np.float64)
    w = np.array(wf_kernel.rope_tables(spec, D)[0], np.float64)[: D // 2].reshape(D // 8, 2, 2)
    ang = np.arange(64)[:, None, None, None] * w[None]
    np.testing.assert_allclose(halves[:, :, 0::2], np.cos(ang), atol=1e-3)  # cos01, cos23
    np.testing.assert_allclose(halves[:, :, 1::2], np.sin(ang), atol=1e-3)  # sin01, sin23
    if dims is None:
        assert (halves[:, :, 0::2] == 1).all() and (halves[:, :, 1::2] == 0).all()


# ---------------------------------------------------------------------------------------- the bits the kernels read
@pytest.mark.parametrize("seed", range(4))
def test_waterfill_key_table_addresses_every_code(seed):
    """Reading each channel as the kernel does (its word and the next from ``key_table``, shift, width
    mask) gives back the codes ``VarLayout.pack`` wrote, for random per-head widths 0..8."""
    rng = np.random.default_rng(seed)
    G, D = 3, 64
    total = int(rng.integers(1, 8)) * D
    bits = np.zeros((G, D), np.int64)
    for g in range(G):  # random widths in 0..8 with the same total per row
        while bits[g].sum() < total:
            c = rng.integers(D)
            if bits[g, c] < 8:
                bits[g, c] += 1
    lay = VarLayout(bits)
    codes = (rng.integers(0, 256, size=(1, G, 9, D)) & ((1 << bits) - 1)[None, :, None, :]).astype(np.uint32)
    words = np.array(lay.pack(mx.array(codes)), np.uint64)
    tab = np.array(wf_kernel.key_table(lay), np.uint64)
    W = words.shape[-1]
    wi, sh, width = tab & 255, (tab >> 8) & 31, (tab >> 16) & 15
    assert (width == bits).all()
    lo = np.take_along_axis(words, wi[None, :, None, :].astype(np.int64).repeat(9, 2), axis=-1)
    hi = np.take_along_axis(words, np.minimum(wi + 1, W - 1)[None, :, None, :].astype(np.int64).repeat(9, 2), axis=-1)
    s = sh[None, :, None, :]
    got = (((lo >> s) | (((hi << (31 - s)) << 1) & 0xFFFFFFFF)) & ((1 << width) - 1)[None, :, None, :])
    np.testing.assert_array_equal(got, codes)


@pytest.mark.parametrize("bits,group", [(2, 32), (4, 32), (4, 64), (8, 128)])
def test_kivi_addressing_reads_what_mlx_quantize_wrote(bits, group):
    """The kernel's reading of KIVI's layout -- key token t of channel c at word (t*b) >> 5, bit
    (t*b) & 31, group t // G; value channel c at word (c*b) >> 5 -- equals ``groupquant.dequantize``."""
    rng = np.random.default_rng(bits * group)
    T, D = 2 * group, 64
    x = mx.array(rng.normal(size=(1, 1, T, D)).astype(np.float32))
    kq = gq.quantize_per_channel(x, bits, group)
    codes, sc, bi = (np.array(a) for a in kq)
    t = np.arange(T)
    w = codes[..., (t * bits) >> 5].astype(np.uint64)  # [1, 1, D, T]
    kv = ((w >> ((t * bits) & 31).astype(np.uint64)) & ((1 << bits) - 1)) * sc[..., t // group].astype(np.float32) \
        + bi[..., t // group].astype(np.float32)
    want = np.array(gq.dequantize_per_channel(*kq, bits, group, transposed=True))
    np.testing.assert_allclose(kv, want, rtol=1e-6, atol=1e-6)
    gv = 32
    vq = gq.quantize(x, bits, gv)
    vc, vs, vb = (np.array(a) for a in vq)
    c = np.arange(D)
    vw = vc[..., (c * bits) >> 5].astype(np.uint64)
    vv = ((vw >> ((c * bits) & 31).astype(np.uint64)) & ((1 << bits) - 1)) * vs[..., c // gv].astype(np.float32) \
        + vb[..., c // gv].astype(np.float32)
    np.testing.assert_allclose(vv, np.array(gq.dequantize(*vq, bits, gv)), rtol=1e-6, atol=1e-6)


def test_kernel_variants_are_named_by_their_source_and_take_their_counts_as_scalars():
    k = _compile.Kernel("vq_t", ["a", "b"], ["o"], [("n", "int"), ("s", "float")], "  o[0] = a[0];")
    sym1, src1 = k.source([mx.float16, mx.uint32], [mx.bfloat16], (("D", 64),))
    sym2, src2 = k.source([mx.bfloat16, mx.uint32], [mx.bfloat16], (("D", 64),))
    sym3, _ = k.source([mx.float16, mx.uint32], [mx.bfloat16], (("D", 128),))
    assert len({sym1, sym2, sym3}) == 3 and sym1.startswith("vq_t_") and sym1 == k.source(
        [mx.float16, mx.uint32], [mx.bfloat16], (("D", 64),))[0]
    assert f'extern "C" __global__ void {sym1}(' in src1 and "VQ_SYMBOL" not in src1
    assert "const vq_f16* __restrict__ a" in src1 and "const vq_bf16* __restrict__ a" in src2
    assert "const vq_u32* __restrict__ b" in src1 and "vq_bf16* __restrict__ o" in src1
    assert "const int n," in src1 and "const int s_bits)" in src1 and "constexpr int D = 64;" in src1
    assert "const float s = __int_as_float(s_bits);" in src1
    n, bits = k.scalar_args([7, 0.1])
    assert n == 7 and np.array([bits], np.int32).view(np.float32)[0] == np.float32(0.1)
    assert [type(x) for x in k.scalar_args([np.int64(7), np.float32(0.1)])] == [int, int]  # what the binding takes


def test_a_kernel_compiles_each_variant_once_and_hands_its_cubin_to_every_call(monkeypatch):
    """One NVRTC compile per variant (constants, dtypes); every call carries that variant's cubin (MLX 0.32 cannot
    run a loaded module by name); a second variant compiles once more."""
    sources, compiled = [], []

    def fake_launch(*, name, compiled_source, inputs, **kw):
        sources.append(compiled_source)
        return [inputs[0] + 1]

    monkeypatch.setattr(_compile, "compile_binary", lambda text, symbol: compiled.append(symbol) or symbol.encode())
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", fake_launch, raising=False)
    k = _compile.Kernel("vq_t", ["a"], ["o"], [("n", "int")], "  o[0] = a[0];")
    x = mx.arange(3, dtype=mx.float32)
    run = lambda d: k([x], [3], (("D", d),), [(3,)], [mx.float32], grid=(32, 1, 1), threads=(32, 1, 1))[0]  # noqa
    outs = [run(4) for _ in range(3)] + [run(8)]
    assert all(bool(mx.array_equal(o, x + 1)) for o in outs)
    assert len(compiled) == 2 and compiled[0] != compiled[1] and all(c.startswith("vq_t_") for c in compiled)
    assert sources == [compiled[0].encode()] * 3 + [compiled[1].encode()]


def test_kivi_kernel_takes_only_the_layouts_it_reads():
    """Value words inside one value group, value rows dividing the warp, registers for rep x tokens per word."""
    assert kivi_kernel.supported(4, 32, 32, 128, 128, rep=4) and kivi_kernel.supported(2, 64, 32, 128, 128, rep=4)
    assert not kivi_kernel.supported(2, 32, 32, 128, 128, rep=8)  # 8 heads x 16 tokens per word: too many registers
    assert not kivi_kernel.supported(8, 32, 32, 256, 256)  # a 64-word value row
    assert not kivi_kernel.supported(4, 32, 32, 96, 96)  # 12 words per value row do not divide the warp
    assert not kivi_kernel.supported(3, 32, 32, 128, 128) and not kivi_kernel.supported(4, 16, 32, 128, 128)
    assert kivi_kernel.supported(8, 32, 32, 128, 128, rep=12)
    assert not kivi_kernel.supported(8, 32, 32, 128, 128, rep=16)  # the block's shared memory over 48 KB


def test_kivi_tensor_core_kernel_takes_4bit_layouts_of_up_to_8_query_heads():
    """The mma form: 4-bit codes, key dims multiples of 16 and value dims of 64 (up to 128: its registers), at most
    8 query heads per KV head (the mma's n); everything else keeps the other kernel."""
    tc = kivi_kernel.tensor_core_layout
    assert tc(4, 32, 32, 128, 128, 4) and tc(4, 64, 32, 64, 64, 8) and tc(4, 32, 128, 128, 64, 1)
    assert not tc(2, 32, 32, 128, 128, 4) and not tc(8, 32, 32, 128, 128, 4)  # other widths
    assert not tc(4, 32, 32, 128, 128, 9)  # more heads than the mma's n
    assert not tc(4, 32, 32, 256, 256, 4) and not tc(4, 32, 32, 128, 96, 4) and not tc(4, 32, 32, 72, 128, 4)


def test_kivi_tensor_cores_need_a_cuda_driver_and_a_2_byte_query(monkeypatch):
    """Without a CUDA driver (a launch stood in on another machine) or with float32 queries the float32 kernel runs;
    an sm_80+ device with float16/bfloat16 queries takes the tensor cores, an older one does not."""
    def no_driver():
        raise RuntimeError("none of ['libcuda.so.1', 'libcuda.so'] could be loaded")

    for arch, dtype, want in ((no_driver, mx.float16, False), (lambda: "sm_90", mx.float16, True),
                              (lambda: "sm_90", mx.bfloat16, True), (lambda: "sm_90", mx.float32, False),
                              (lambda: "sm_75", mx.float16, False), (lambda: "sm_100", mx.float16, True)):
        monkeypatch.setattr(_compile, "_arch", arch)
        _compile.tensor_cores_here.cache_clear()
        assert kivi_kernel.uses_tensor_cores(4, 32, 32, 128, 128, 4, dtype) is want, (arch, dtype)
    _compile.tensor_cores_here.cache_clear()


@GPU
@pytest.mark.parametrize("H,R,D,group,prompt,dtype", [
    (8, 4, 128, 32, 4100, mx.bfloat16), (2, 8, 128, 64, 999, mx.float16), (3, 3, 64, 32, 45, mx.float16),
    (1, 1, 64, 128, 161, mx.float16), (2, 5, 128, 32, 20011, mx.float16), (4, 2, 128, 32, 96, mx.float16)])
@pytest.mark.parametrize("max_splits", [None, 2])
def test_kivi_tensor_core_kernel_equals_the_other_kernel_and_the_op_path(H, R, D, group, prompt, dtype, max_splits,
                                                                         monkeypatch):
    """The tensor-core kernel (float16 dequantized codes and weights, float32 sums) against the op path and the
    float32 kernel, over half-full last tiles, GQA ratios up to 8 and splits that take several tiles."""
    if max_splits:
        monkeypatch.setattr(kivi_kernel, "MAX_SPLITS", max_splits)
    c = _kivi(D, 4, group)
    rng = np.random.default_rng(prompt + R)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D, dtype), _rows(rng, H, prompt, D, dtype))
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    for _ in range(2):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D, dtype), _rows(rng, H, 1, D, dtype))
        q = _rows(rng, H * R, 1, D, dtype)
        assert kivi_kernel.uses_tensor_cores(4, group, c.value_group(D), D, D, R, dtype)
        assert not kivi_kernel.uses_tensor_cores(4, group, c.value_group(D), D, D, R, mx.float32)

        def op():
            c.attend_path = "dequant"
            try:
                return c.attend(q, K, V, scale=D**-0.5, mask=None)
            finally:
                c.attend_path = "auto"

        call = c._call
        got, want = _kernel_vs_op(c, q, D**-0.5, None, op)
        monkeypatch.setattr(kivi_kernel, "TENSOR_CORES", False)
        c._call = call
        other = c._decode_attend(q, scale=D**-0.5)
        monkeypatch.setattr(kivi_kernel, "TENSOR_CORES", True)
        assert got.dtype == dtype and _rel(got.astype(mx.float32), want.astype(mx.float32)) < tol
        assert _rel(got.astype(mx.float32), other.astype(mx.float32)) < tol

@GPU
@pytest.mark.parametrize("H,R,D,prompt,dtype,rope", [
    (8, 4, 128, 4100, mx.bfloat16, True), (2, 8, 128, 999, mx.float16, True), (3, 3, 64, 45, mx.float16, True),
    (1, 1, 64, 161, mx.float16, False), (2, 5, 128, 20011, mx.float16, True), (4, 2, 128, 96, mx.float16, False)])
@pytest.mark.parametrize("max_splits", [None, 2])
def test_waterfill_tensor_core_form_equals_the_float32_kernel_and_the_op_path(H, R, D, prompt, dtype, rope, max_splits,
                                                                              monkeypatch):
    """The mma form (float16 keys turned within the tile, centroids, rotated query and weights; float32 sums) against
    the op path and the float32 kernel: half-full last tiles, GQA ratios up to 8, splits taking several tiles, long
    positions (the query turned to each tile's start)."""
    if max_splits:
        monkeypatch.setattr(_common, "MAX_SPLITS", max_splits)
        monkeypatch.setattr(wf_kernel, "split_count", lambda n: min(max_splits, split_count(n)))
    c = _waterfill(D, nn.RoPE(D, base=10000.0) if rope else None)
    rng = np.random.default_rng(prompt + R)
    _feed_waterfill(c, H, R, D, prompt, rng, dtype)
    tol = 1e-2 if dtype == mx.bfloat16 else 3e-3
    for _ in range(2):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D, dtype), _rows(rng, H, 1, D, dtype))
        q = _rows(rng, H * R, 1, D, dtype)
        assert c._decode_kernel_ready(q, K, None)
        assert wf_kernel.uses_tensor_cores(D, D, 4, R, True, dtype)
        call = c._call
        got, want = _kernel_vs_op(c, q, D**-0.5, None, lambda: ResidualWindowCache.attend(
            c, q, K, V, scale=D**-0.5, mask=None, sinks=None))
        monkeypatch.setattr(wf_kernel, "TENSOR_CORES", False)
        c._call = call
        other = c._decode_attend(q, scale=D**-0.5)
        monkeypatch.setattr(wf_kernel, "TENSOR_CORES", True)
        assert got.dtype == dtype and bool(mx.isfinite(got.astype(mx.float32)).all())
        assert _rel(got.astype(mx.float32), want.astype(mx.float32)) < tol
        assert _rel(got.astype(mx.float32), other.astype(mx.float32)) < tol


# ---------------------------------------------------------------------------------------- waterfill's rotation
@pytest.mark.parametrize("dv", [16, 64, 128])
def test_value_rotation_is_a_transform_equal_to_the_hadamard_matrix(dv):
    y = mx.random.normal((3, 5, dv), key=mx.random.key(dv))
    m = np.array(value_rotation(dv, 0), np.float64)
    np.testing.assert_allclose(np.array(rotate_values(y, 0)), np.array(y, np.float64) @ m, atol=1e-5)
    np.testing.assert_allclose(np.array(rotate_values(rotate_values(y, 0), 0, inverse=True)), np.array(y),
                               atol=1e-5)


def test_waterfill_holds_no_rotation_matrix_for_power_of_two_dims():
    c = _waterfill(64, None)
    _feed_waterfill(c, 2, 2, 64, 100, np.random.default_rng(0))
    assert c.constant_nbytes == 0
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    assert not any(a.shape == (64, 64) and a.dtype == mx.float32 for a in c.held_arrays())


# ---------------------------------------------------------------------------------------- op path vs float64
def _waterfill(D, rope, **kw):
    return make_waterfill(rope=rope, D=D, **kw)  # tests/test_waterfill.py's constructor


def _kivi(D, bits=4, group=32):
    c = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=bits, head_dim=D,
                                            options=KIVIOptions(group_size=group)))
    assert isinstance(c, KIVIKVCache)
    return c


def _kivi_sink(D, bits=4, group=32, sinks=4):
    c = KVCacheFactory.create(KVCacheConfig(method="kivi_sink", bit_width_inlier=bits, head_dim=D,
                                            options=KIVISinkOptions(group_size=group, n_sink_tokens=sinks)))
    assert isinstance(c, KIVISinkKVCache)
    return c


def _tq(D, residual_length=16, **opts):
    """A TurboQuant-RVQ cache of head dim ``D`` with a short float16 window (rows reach the codes early)."""
    c = KVCacheFactory.create(KVCacheConfig(method="turboquant_rvq", head_dim=D,
                                            options=TurboQuantRVQOptions(residual_length=residual_length, **opts)))
    assert isinstance(c, TurboQuantRVQKVCache)
    return c


def _rows(rng, H, n, D, dtype=mx.float32, scale=1.0):
    return mx.array((rng.normal(size=(1, H, n, D)) * scale).astype(np.float32)).astype(dtype)


def _kivi_batch(D, H, lengths, bits=4, group=32, dtype=mx.float32, seed=0):
    """A KIVI batch cache merged from single caches holding ``lengths`` random rows (ragged), and the rng."""
    rng = np.random.default_rng(seed)
    singles = [_kivi(D, bits, group) for _ in lengths]
    for c, n in zip(singles, lengths):
        if n:
            c.update_and_fetch(_rows(rng, H, n, D, dtype), _rows(rng, H, n, D, dtype))
    return KIVIKVCache.merge(singles), rng


def _batch_rows(rng, B, H, D, dtype=mx.float32):
    return mx.array(rng.normal(size=(B, H, 1, D)).astype(np.float32)).astype(dtype)


def _feed_waterfill(c, H, R, D, n, rng, dtype=mx.float32):
    k, v = _rows(rng, H, n, D, dtype), _rows(rng, H, n, D, dtype)
    q = _rows(rng, H * R, n, D, dtype)
    K, V = c.update_and_fetch(k, v)
    return dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal")


@pytest.mark.parametrize("H,R,D,prompt,steps,rope", [
    (1, 1, 64, 37, 20, None),
    (2, 3, 64, 101, 19, "rope"),
    (3, 4, 32, 64, 33, "traditional"),
    (2, 2, 64, 161, 18, "rope")])
def test_waterfill_decode_op_path_equals_float64_attention_over_the_stored_rows(H, R, D, prompt, steps, rope, op_path):
    """Each decode step (crossing window compactions: 16-row blocks leave a 16 + 16 row window; the
    first 4 rows are float16 sinks) attends over exactly the rows the cache stores: float64 attention
    over ``update_and_fetch``'s rows, with and without sink logits."""
    r = None if rope is None else nn.RoPE(D, traditional=rope == "traditional", base=10000.0)
    c = _waterfill(D, r)
    rng = np.random.default_rng(H * 100 + prompt)
    _feed_waterfill(c, H, R, D, prompt, rng)
    assert c.calibrated
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32))
    for i in range(steps):
        k, v, q = _rows(rng, H, 1, D), _rows(rng, H, 1, D), _rows(rng, H * R, 1, D)
        K, V = c.update_and_fetch(k, v)
        sk = sinks if i % 2 else None
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None, sinks=sk)
        want = _softmax_attention64(q, K, V, D**-0.5, None if sk is None else np.array(sk))
        assert _rel(out, want) < TOL_ATTN, (i, c.n_sink, c.n_quant, c.n_win)
    assert c.n_sink == 4 and c.n_quant > 0


@pytest.mark.parametrize("H,R,D,bits,group,prompt,steps", [
    (1, 1, 64, 4, 32, 33, 40), (2, 3, 64, 2, 32, 95, 36), (2, 4, 128, 8, 64, 64, 70)])
def test_kivi_decode_op_path_equals_float64_attention_over_the_stored_rows(H, R, D, bits, group, prompt, steps):
    """KIVI decode steps across group boundaries (a group of G tokens is quantized after the step that
    completes it) attend over exactly the rows the cache stores."""
    c = _kivi(D, bits, group)
    rng = np.random.default_rng(bits * 10 + prompt)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    for i in range(steps):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        assert _rel(out, _softmax_attention64(q, K, V, D**-0.5)) < TOL_ATTN, (i, c.n_quant, c.n_res)
    assert c.n_quant >= group


# ---------------------------------------------------------------------------------------- the op path's pieces
EPS32 = float(np.finfo(np.float32).eps)


def test_softmax_exp_equals_float64_exp():
    """The joint softmax's exponential: within a few float32 roundings of float64 ``exp`` for every
    normal result, exactly 0 at -inf, and 0 or a denormal below float32's range."""
    rng = np.random.default_rng(0)
    x = np.concatenate([-np.abs(rng.normal(0, 20, 20000)), -rng.uniform(0, 1e-3, 500),
                        -np.log(2) * (np.arange(126) + 0.5), [0.0, -np.inf, -87.3, -90.0, -200.0]])
    x = x.astype(np.float32)
    got = np.array(softmax_exp(mx.array(x)), np.float64)
    want = np.exp(x.astype(np.float64))
    normal = want >= np.finfo(np.float32).tiny
    assert np.all(np.abs(got - want)[normal] <= 8 * EPS32 * want[normal])  # ~8 roundings of the evaluation
    assert np.all(got[~normal] < np.finfo(np.float32).tiny) and np.all(got[~normal] >= 0)
    assert got[np.isneginf(x)][0] == 0.0


def _rope64(k, spec, pos):
    """float64 RoPE of rows ``k [B, H, n, D]`` at positions ``pos [n]`` (``spec`` as ``rope_spec``)."""
    dims, half = spec["dims"], spec["dims"] // 2
    w = spec["scale"] * float(spec["base"]) ** (-2.0 * np.arange(half) / dims)
    ang = np.asarray(pos, np.float64)[:, None] * w
    c, s = np.cos(ang), np.sin(ang)
    out = k.copy()
    if spec["traditional"]:
        a, b = np.arange(0, dims, 2), np.arange(1, dims, 2)
    else:
        a, b = np.arange(half), np.arange(half, dims)
    out[..., a] = k[..., a] * c - k[..., b] * s
    out[..., b] = k[..., a] * s + k[..., b] * c
    return out


@pytest.mark.parametrize("bits,rope,dims,R", [(4, "traditional", 64, 3), (4, "rope", 64, 1), (3, None, 64, 2),
                                              (5, "traditional", 32, 4), (2, "rope", 48, 3)])
def test_waterfill_scores_and_value_sums_equal_a_float64_decoding_of_the_codes(bits, rope, dims, R):
    """The decode op path's scores (byte-pair unpacking, RoPE on the pair halves) and value sums (per-byte
    nibbles at 4 bits) over odd row ranges equal float64 from the layout's own unpacking (``VarLayout.
    unpack``, ``unpack_bits``) and float64 RoPE; widths spread over 0..8 bits (uneven channel scales)."""
    H, D = 2, 64
    r = None if rope is None else nn.RoPE(dims, traditional=rope == "traditional", base=10000.0)
    c = make_waterfill(bits=bits, rope=r, D=D)
    rng = np.random.default_rng(bits * 7 + dims)
    chan = np.exp(rng.normal(0, 1.5, D)).astype(np.float32)
    k = mx.array((rng.normal(size=(1, H, 203, D)) * chan).astype(np.float32))
    K, V = c.update_and_fetch(k, _rows(rng, H, 203, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 203, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    widths = np.array(c.k_bits[0, :, 0])
    assert c.n_quant > 100 and widths.max() >= bits + 2 and widths.min() <= bits - 2
    lay, q0 = c._layout_of(), c.n_quant
    for a, b in [(0, q0), (5, q0 - 3), (q0 - 1, q0)]:
        codes = np.array(lay.unpack(c.k_words[:, :, a:b]), np.float64)
        keys = np.array(c.k_lo, np.float64) + codes * np.array(c.k_step, np.float64)
        pos = c.n_sink + a + np.arange(b - a)
        if r is not None:
            keys = _rope64(keys, rope_spec(r), pos)
        q = rng.normal(size=(1, H, R, D))
        got = c._key_scores(mx.array(q.astype(np.float32)), a, b)
        max_angle = float(pos[-1]) if r is not None else 0.0  # float32 angles: ~eps * angle each
        # on a GPU the matmuls may round float32 inputs (TF32): TOL32 bounds that instead
        tol = 8 * EPS32 * (1 + max_angle) if mx.default_device() == mx.cpu else max(TOL32, 8 * EPS32 * max_angle)
        assert _rel(got, np.einsum("bhrd,bhnd->bhrn", q, keys)) < tol, (a, b)

        vcodes = np.array(unpack_bits(c.v_words[:, :, a:b], bits, D), np.float64)
        pa, pb, pc = odd_poly_gaussian(bits)[1]
        u = vcodes - ((1 << bits) - 1) / 2
        vals = (pa * u + pb * u**3 + pc * u**5) * np.array(c.v_scales[:, :, a:b], np.float64)[..., None]
        p = rng.uniform(size=(1, H, R, b - a))
        got = c._weighted_values(mx.array(p.astype(np.float32)), a, b)
        assert _rel(got, np.einsum("bhrn,bhnd->bhrd", p, vals)) < TOL32, (a, b)


# ---------------------------------------------------------------------------------------- kernels (CUDA only)
def _kernel_vs_op(c, q, scale, sinks, op):
    """The kernel path and the op path on the same recorded step: (kernel output, op output)."""
    call = c._call
    got = c._decode_attend(q, scale=scale, sinks=sinks)
    c._call = call
    want = op()
    mx.eval(got, want)
    return got, want


@GPU
@pytest.mark.parametrize("method,H,R,D,prompt,dtype,with_sinks,kw", [
    ("waterfill", 2, 1, 64, 45, mx.float16, False, {"rope": None}),
    ("waterfill", 8, 4, 128, 301, mx.float16, True, {"rope": "rope"}),
    ("waterfill", 3, 3, 64, 1037, mx.bfloat16, False, {"rope": "traditional"}),
    ("waterfill", 8, 4, 128, 5000, mx.bfloat16, True, {"rope": "rope"}),
    ("waterfill", 4, 2, 128, 777, mx.float32, False, {"rope": "rope"}),
    ("waterfill", 2, 8, 128, 700, mx.float16, True, {"rope": "rope", "bits": 2}),
    ("waterfill", 3, 3, 64, 500, mx.float32, False, {"rope": "rope", "bits": 3}),
    ("waterfill", 2, 16, 64, 400, mx.bfloat16, False, {"rope": "rope", "dims": 32}),
    ("waterfill", 1, 32, 64, 300, mx.float16, True, {"rope": "traditional", "bits": 8}),
    ("turboquant_rvq", 2, 1, 64, 61, mx.float16, False, {}),
    ("turboquant_rvq", 8, 4, 128, 301, mx.float16, True, {}),
    ("turboquant_rvq", 3, 3, 64, 1037, mx.bfloat16, False, {}),
    ("turboquant_rvq", 8, 4, 128, 5000, mx.bfloat16, True, {}),
    ("turboquant_rvq", 4, 2, 128, 777, mx.float32, False, {}),
    ("turboquant_rvq", 2, 2, 64, 300, mx.float16, True,
     {"key_codebook_bits": 8, "value_codebook_bits": 12, "value_sub_dim": 4}),
    ("turboquant_rvq", 2, 4, 64, 200, mx.float16, False, {"key_codebook_bits": 10, "key_sub_dim": 2}),
    ("turboquant_rvq", 2, 2, 128, 150, mx.float16, True, {"key_codebook_bits": 7, "value_codebook_bits": 6})])
def test_window_kernels_equal_the_op_path(method, H, R, D, prompt, dtype, with_sinks, kw):
    """The residual-window caches' decode kernels against their op path on the same steps: waterfill (RoPE on the
    key pairs within a lane or on the query side (traditional, partial), none; 1 to 32 query heads per KV head; value
    codes in whole words or straddling them), TurboQuant-RVQ (lane-per-token scores on the codes, the dense rotation
    back in the fused tail; default codebooks, one-stage keys, two-stage values, 2-bit sub-vectors, codes straddling
    words)."""
    if method == "waterfill":
        c = _waterfill(D, None if kw["rope"] is None else nn.RoPE(kw.get("dims", D), base=10000.0,
                                                                  traditional=kw["rope"] == "traditional"),
                       bits=kw.get("bits", 4))
    else:
        c = _tq(D, **kw)
    rng = np.random.default_rng(prompt)
    _feed_waterfill(c, H, R, D, prompt, rng, dtype)
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    for _ in range(3):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D, dtype), _rows(rng, H, 1, D, dtype))
        q = _rows(rng, H * R, 1, D, dtype)
        assert c._decode_kernel_ready(q, K, None)
        got, want = _kernel_vs_op(c, q, D**-0.5, sinks, lambda: ResidualWindowCache.attend(
            c, q, K, V, scale=D**-0.5, mask=None, sinks=sinks))
        assert got.dtype == dtype and bool(mx.isfinite(got.astype(mx.float32)).all())
        assert _rel(got.astype(mx.float32), want.astype(mx.float32)) < tol


@GPU
@pytest.mark.parametrize("H,D,bits,prompt,rope,dtype", [
    (2, 64, 4, 45, None, mx.float16),
    (8, 128, 4, 3000, "rope", mx.bfloat16),
    (3, 64, 3, 1037, "traditional", mx.float32),
    (4, 128, 2, 777, "rope", mx.float16)])
def test_waterfill_prefill_kernels_equal_the_op_path(H, D, bits, prompt, rope, dtype):
    """The rows kernels against waterfill's op path on the same cache: the dense rows a GPU prefill chunk
    attends over (float32 out: to float32 rounding; the model's dtype: to its rounding) and the codes of new
    rows (the same but for float32 rounding ties: at most 1 in 1000 codes differ, each by one level)."""
    r = None if rope is None else nn.RoPE(D, traditional=rope == "traditional", base=10000.0)
    c = _waterfill(D, r, bits=bits)
    rng = np.random.default_rng(prompt)
    _feed_waterfill(c, H, 2, D, prompt, rng, dtype)
    n = c.n_quant
    assert n > 0 and wf_rows.supported(c)
    want = c._decoded(n)
    for out_dtype, tol in ((mx.float32, 1e-4), (dtype, 1e-2 if dtype == mx.bfloat16 else 2e-3)):
        got = wf_rows.decode_rows(c, n, out_dtype)
        for g, w in zip(got, want):
            assert g.dtype == out_dtype and g.shape == w.shape
            assert _rel(g.astype(mx.float32), w) < tol
    k, v = _rows(rng, H, 50, D, dtype), _rows(rng, H, 50, D, dtype)
    got, want = wf_rows.encode_rows(c, k, v, c.n_sink + n), c._encoded(k, v, c.n_sink + n)
    lay = c._layout_of()
    pairs = ((lay.unpack(got[0]), lay.unpack(want[0])), (unpack_bits(got[1], bits, D), unpack_bits(want[1], bits, D)))
    for g, w in pairs:
        g, w = np.array(g).astype(np.int64), np.array(w).astype(np.int64)
        assert np.mean(g != w) <= 1e-3 and np.abs(g - w).max() <= 1
    assert got[2].dtype == mx.float16 and _rel(got[2].astype(mx.float32), want[2].astype(mx.float32)) < 1e-3


@GPU
@pytest.mark.parametrize("opts,dtype", [
    ({}, mx.bfloat16), ({"key_codebook_bits": 7, "value_codebook_bits": 16}, mx.float16),
    ({"key_sub_dim": 2, "value_sub_dim": 16, "value_codebook_bits": 10}, mx.float32)])
def test_turboquant_rvq_rows_kernel_equals_the_op_path(opts, dtype):
    """The rotated-domain rows a GPU prefill chunk attends over, from the kernel and from the op path (the codebook's
    decode times the norms): equal to the output dtype's rounding; and a whole chunk through ``_rotated_chunk`` with
    the kernel equals float64 attention over the rows ``update_and_fetch`` returned."""
    D, H, R = 64, 2, 3
    c = _tq(D, **opts)
    rng = np.random.default_rng(7)
    c.update_and_fetch(_rows(rng, H, 301, D, dtype), _rows(rng, H, 301, D, dtype))
    n = c.n_quant
    assert n > 0
    for prefix, qz in zip(("k_", "v_"), c._qs()):
        planes = (getattr(c, prefix + "codes1"), getattr(c, prefix + "codes2", None))
        norms = getattr(c, prefix + "norms")
        got = tq_rows.rotated_rows(qz.cb, planes, norms, n, dtype)
        want = qz.decode_rotated(*c._planes(prefix, n)) * norms[:, :, :n].astype(mx.float32)[..., None]
        assert got.dtype == dtype and got.shape == want.shape
        assert _rel(got.astype(mx.float32), want) < (1e-5 if dtype == mx.float32 else 1e-2)
        exact = _rows(rng, H, 9, D, dtype)  # the attention's whole keys or values: exact rows around the decoded
        full = tq_rows.rotated_rows(qz.cb, planes, norms, n, dtype, exact, 4)
        assert full.shape == (1, H, n + 9, D) and bool(mx.array_equal(full[:, :, :4], exact[:, :, :4]))
        assert bool(mx.array_equal(full[:, :, 4 + n:], exact[:, :, 4:]))
        assert _rel(full[:, :, 4 : 4 + n].astype(mx.float32), want) < (1e-5 if dtype == mx.float32 else 1e-2)
    K, V = c.update_and_fetch(_rows(rng, H, 33, D, dtype), _rows(rng, H, 33, D, dtype))
    q = _rows(rng, H * R, 33, D, dtype)
    out = c._rotated_chunk(q, c._call, scale=D**-0.5, mask="causal", sinks=None)
    qf, kf, vf = (np.asarray(x.astype(mx.float32), np.float64) for x in (q, K, V))
    s = np.einsum("bhrnd,bhmd->bhrnm", qf.reshape(1, H, R, 33, D), kf) * D**-0.5
    s = np.where(np.arange(K.shape[2])[None] <= np.arange(33)[:, None] + K.shape[2] - 33, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (np.einsum("bhrnm,bhmd->bhrnd", p, vf) / p.sum(-1, keepdims=True)).reshape(1, H * R, 33, D)
    assert _rel(out.astype(mx.float32), want) < (TOL32 if dtype == mx.float32 else 2e-2)


@GPU
@pytest.mark.parametrize("dim,sub_dim,bits,rows", [
    (128, 4, 12, 3000),  # TurboQuant-RVQ's keys at the defaults: 32 sub-vectors, 8 + 4 bits
    (128, 8, 8, 2049),  # its values: one stage
    (64, 2, 10, 777),  # 2-coordinate pieces, a 2-bit second stage
    (96, 8, 16, 300),  # 256 x 256 centroids, 12 sub-vectors
    (64, 4, 6, 1001),  # one stage of 6 bits: codes straddle words
    (80, 4, 7, 65)])  # 20 sub-vectors of 7 bits
def test_rvq_encode_kernel_equals_the_op_path(dim, sub_dim, bits, rows):
    """TurboQuant-RVQ's encode kernel against the codebook's op path on rotated unit vectors, in ``bitpack``'s
    layout (unpacked by the op path's ``unpack_bits``): the same codes but for rounding ties (the kernel's distances
    are float32 sums, the op path's a GPU matmul that may round its inputs: measured 0.15% of codes on the H200 with
    256 x 256 centroids) and a total distortion no larger than the op path's (to 1e-4 relative)."""
    cb = rvq_codebook(dim, sub_dim, bits, 0)
    assert tq_rows.supported(cb)
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(2, 3, rows, dim)).astype(np.float32)
    y = mx.array(x / np.linalg.norm(x, axis=-1, keepdims=True))
    i, j = cb.encode(y)
    w1, w2 = tq_rows.encode_words(cb, y)
    gi = unpack_bits(w1, cb.bits1, cb.n_sub)
    gj = unpack_bits(w2, cb.bits2, cb.n_sub) if j is not None else None
    assert (w2 is None) == (j is None) and gi.shape == i.shape
    err = [float(mx.sum((cb.decode(a, b) - y) ** 2)) for a, b in ((gi, gj), (i, j))]
    assert err[0] <= err[1] * (1 + 1e-4)
    for g, w in ((gi, i), (gj, j)):
        if w is not None:
            assert np.mean(np.array(g) != np.array(w)) <= 1e-2


def test_rotated_chunk_plumbing_of_the_rows_kernel_equals_float64_attention(reference_kernels):
    """With the rows kernel stood in by the op path's decoded rows, GPU-style prefill chunks (``_rotated_chunk``) over
    quantized rows, sinks and a window give float64 attention over the rows ``update_and_fetch`` returned, and the
    kernel path passes its first-use check (on the CPU no test reached the kernel branch of ``_rotated_chunk``)."""
    H, R, D = 2, 2, 64
    c = reference_kernels["turboquant_rvq"] = _tq(D, residual_length=16)
    c._attend_chunk = lambda q, k, v, call, *, scale, mask, sinks, tile=None: c._rotated_chunk(
        q, call, scale=scale, mask=mask, sinks=sinks)
    rng = np.random.default_rng(3)
    dispatch.install()
    for n in (70, 45, 33):
        K, V = c.update_and_fetch(_rows(rng, H, n, D), _rows(rng, H, n, D))
        q = _rows(rng, H * R, n, D)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal")
        qf, kf, vf = (np.asarray(x, np.float64) for x in (q, K, V))
        s = np.einsum("bhrnd,bhmd->bhrnm", qf.reshape(1, H, R, n, D), kf) * D**-0.5
        s = np.where(np.arange(K.shape[2])[None] <= np.arange(n)[:, None] + K.shape[2] - n, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (np.einsum("bhrnm,bhmd->bhrnd", p, vf) / p.sum(-1, keepdims=True)).reshape(1, H * R, n, D)
        assert _rel(out, want) < TOL_ATTN, n
    assert c.n_sink == 4 and c.n_quant > 0 and reference_kernels["tq_rows_launches"] >= 4
    assert "turboquant_rvq_rows" in _common._checked and not _common._disabled


@GPU
@pytest.mark.parametrize("sub_dim,bits", [(4, 12), (8, 8)])  # the defaults' keys and values
def test_rvq_encode_rows_kernel_scales_rows_by_their_norm_as_the_op_path(sub_dim, bits):
    """``encode_rows`` takes the rotated rows ``Pi x`` and writes the norms with the codes: the op path's norms (to
    float16's rounding; a zero row 0, a row past float16's range clamped to 65504) and its codes but for rounding
    ties (<= 1%), on rows of very different norms."""
    from veloxquant_mlx.cache.methods.quantization.turboquant_rvq import _quantizer

    qz = _quantizer(128, sub_dim, bits, 0, None)
    rng = np.random.default_rng(sub_dim)
    x = rng.normal(size=(2, 3, 700, 128)) * np.exp(rng.uniform(-4, 4, size=(2, 3, 700, 1)))
    x[0, 0, 5] = 0.0
    x[1, 2, 9] *= 1e5 / np.linalg.norm(x[1, 2, 9])
    x = mx.array(x.astype(np.float32))
    got = tq_rows.encode_rows(qz.cb, x @ qz.rot_t)
    want = qz._encoded(x)
    assert got[2].dtype == mx.float16 and got[2].shape == (2, 3, 700)
    assert _rel(got[2].astype(mx.float32), want[2].astype(mx.float32)) < 2e-3
    assert float(got[2][0, 0, 5]) == 0.0 and float(got[2][1, 2, 9]) == 65504.0
    for g, w, b in zip(got[:2], want[:2], (qz.cb.bits1, qz.cb.bits2)):
        assert (g is None) == (w is None)
        if w is not None:
            assert np.mean(np.array(unpack_bits(g, b, qz.cb.n_sub)) != np.array(unpack_bits(w, b, qz.cb.n_sub))) <= 1e-2


@GPU
@pytest.mark.parametrize("H,R,D,bits,group,prompt,dtype", [
    (2, 1, 64, 4, 32, 45, mx.float16), (8, 4, 128, 4, 32, 4100, mx.bfloat16),
    (3, 3, 64, 2, 64, 700, mx.float16), (4, 2, 128, 8, 128, 999, mx.float16),
    (8, 8, 128, 8, 32, 20011, mx.bfloat16), (2, 4, 128, 2, 64, 2500, mx.float16), (1, 1, 32, 4, 32, 33, mx.float32)])
@pytest.mark.parametrize("max_splits", [None, 2])
def test_kivi_kernel_equals_the_op_path(H, R, D, bits, group, prompt, dtype, max_splits, monkeypatch):
    if max_splits:  # splits that each take several tiles (the cap of very long contexts)
        monkeypatch.setattr(kivi_kernel, "MAX_SPLITS", max_splits)
    c = _kivi(D, bits, group)
    rng = np.random.default_rng(prompt)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D, dtype), _rows(rng, H, prompt, D, dtype))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D, dtype), K, V, cache=c, scale=D**-0.5, mask="causal")
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    for _ in range(3):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D, dtype), _rows(rng, H, 1, D, dtype))
        q = _rows(rng, H * R, 1, D, dtype)
        assert c._decode_kernel_ready(None, D, D, R)

        def op():
            c.attend_path = "dequant"  # the op path (the kernel only takes attend_path="auto")
            try:
                return c.attend(q, K, V, scale=D**-0.5, mask=None)
            finally:
                c.attend_path = "auto"

        got, want = _kernel_vs_op(c, q, D**-0.5, None, op)
        assert got.dtype == dtype and _rel(got.astype(mx.float32), want.astype(mx.float32)) < tol


@GPU
@pytest.mark.parametrize("H,R,D,bits,group,lengths,dtype,with_sinks", [
    (2, 1, 64, 4, 32, (66, 130, 5, 0), mx.float16, False),
    (8, 4, 128, 4, 32, (4100, 31, 2500), mx.bfloat16, True),
    (4, 2, 128, 2, 64, (700, 64, 1300, 129), mx.float16, False)])
def test_kivi_batch_kernel_equals_the_op_path(H, R, D, bits, group, lengths, dtype, with_sinks):
    """The batch form's kernel (per-sequence counts: groups, right-aligned residual rows) equals its op path over
    ragged sequences, through steps where residuals complete groups at different steps (and one sequence with
    no group yet)."""
    c, rng = _kivi_batch(D, H, lengths, bits, group, dtype)
    B, scale = len(lengths), D**-0.5
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    tol = 1e-2 if dtype == mx.bfloat16 else 2e-3
    for i in range(2 * group + 3):
        K, V = c.update_and_fetch(_batch_rows(rng, B, H, D, dtype), _batch_rows(rng, B, H, D, dtype))
        q, call = _batch_rows(rng, B, H * R, D, dtype), c._call
        assert c._kernel_ready(q, call[6], call[7])
        got = c._kernel_attend(q, call, scale=scale, sinks=sinks)
        want = c._attend_call(q, call, scale=scale, mask=None, sinks=sinks)
        c._call = None
        assert got.dtype == dtype and _rel(got.astype(mx.float32), want.astype(mx.float32)) < tol, i


@GPU
@pytest.mark.parametrize("method,H,R,D,lengths,dtype,with_sinks,how", [
    ("waterfill", 2, 1, 64, (77, 300, 40, 5), mx.float16, False, None),
    ("waterfill", 8, 4, 128, (5000, 301, 40, 1100), mx.bfloat16, True, "rope"),
    ("turboquant_rvq", 2, 1, 64, (77, 300, 40, 5), mx.float16, False, {}),
    ("turboquant_rvq", 8, 4, 128, (5000, 301, 40, 1100), mx.bfloat16, True, {}),
    ("turboquant_rvq", 2, 3, 64, (500, 33, 17), mx.float16, True, {"value_codebook_bits": 12, "value_sub_dim": 4})])
def test_batch_kernel_equals_the_op_path(method, H, R, D, lengths, dtype, with_sinks, how):
    """Waterfill's and TurboQuant-RVQ's batch kernels (per-sequence counts; waterfill's key tables per sequence and
    head) equal their op path over ragged sequences, through steps where windows flush at different steps. ``how``:
    waterfill's RoPE, or TurboQuant-RVQ's options."""
    rng = np.random.default_rng(len(lengths) + H)
    if method == "waterfill":
        c = _waterfill_batch(H, R, D, None if how is None else nn.RoPE(D, base=10000.0), lengths, rng, dtype)
    else:
        c = _tq_batch(H, R, D, lengths, rng, dtype, **how)
    B, scale = len(lengths), D**-0.5
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    tol = 1e-2 if dtype == mx.bfloat16 else 3e-3
    for i in range(40):
        K, V = c.update_and_fetch(_batch_rows(rng, B, H, D, dtype), _batch_rows(rng, B, H, D, dtype))
        q, call = _batch_rows(rng, B, H * R, D, dtype), c._call
        assert c._one_row_step(q, K, call, None) and c._gpu_step_ready(q)
        got = c._gpu_step(q, call, scale=scale, sinks=sinks)
        want = c._attend_op(q, K, V, call, scale=scale, mask=None, sinks=sinks)
        c._call = None
        assert got.dtype == dtype and _rel(got.astype(mx.float32), want.astype(mx.float32)) < tol, i


@GPU
@pytest.mark.parametrize("method,H,R,D,prompt,dtype,with_sinks,max_splits,fused_max", [
    ("kivi", 2, 1, 64, 45, mx.float16, False, None, None), ("kivi", 8, 4, 128, 20011, mx.bfloat16, True, None, None),
    ("kivi", 3, 3, 64, 700, mx.float16, True, 1, None), ("waterfill", 2, 3, 64, 101, mx.float16, True, None, None),
    ("waterfill", 8, 4, 128, 5000, mx.bfloat16, False, None, None),
    ("waterfill", 2, 2, 64, 3000, mx.float16, True, None, 2), ("kivi", 2, 4, 128, 3000, mx.float16, True, None, 2),
    ("turboquant_rvq", 8, 4, 128, 5000, mx.bfloat16, True, None, None),
    ("turboquant_rvq", 2, 3, 64, 101, mx.float16, False, None, None),
    ("turboquant_rvq", 2, 2, 64, 3000, mx.float16, True, None, 2)])
def test_fused_kernel_equals_its_partials_merged(method, H, R, D, prompt, dtype, with_sinks, max_splits, fused_max,
                                                 monkeypatch):
    """One launch per layer: the decode kernel's last block per KV head merging the splits (sink logits,
    waterfill's rotation back from the Hadamard domain) gives what the same kernel's partials merged by the op
    path give, from one split to dozens; past ``FUSED_MAX_S1`` partials (lowered here) the merge kernel does.
    Every step counts its blocks in the cache's same counters, which each launch leaves at zero."""
    mod, name = {"kivi": (kivi_kernel, "kivi_partials"), "waterfill": (wf_kernel, "waterfill_partials"),
                 "turboquant_rvq": (tq_kernel, "tq_partials")}[method]
    if max_splits:
        monkeypatch.setattr(kivi_kernel, "MAX_SPLITS", max_splits)
    if fused_max:
        monkeypatch.setattr(_common, "FUSED_MAX_S1", fused_max)
    real, seen = getattr(mod, name), []

    def spy(*args, merge=None, **kw):
        out = real(*args, merge=merge, **kw)
        seen.append((out, real(*args, **kw), merge))
        return out

    monkeypatch.setattr(mod, name, spy)
    rng = np.random.default_rng(prompt)
    c = {"kivi": lambda: _kivi(D), "turboquant_rvq": lambda: _tq(D),
         "waterfill": lambda: _waterfill(D, nn.RoPE(D, base=10000.0))}[method]()
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D, dtype), _rows(rng, H, prompt, D, dtype))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D, dtype), K, V, cache=c, scale=D**-0.5, mask="causal")
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    for _ in range(3):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D, dtype), _rows(rng, H, 1, D, dtype))
        mx.eval(dispatch.dispatched_sdpa(_rows(rng, H * R, 1, D, dtype), K, V, cache=c, scale=D**-0.5, mask=None,
                                         sinks=sinks))
    assert len(seen) >= 3
    splits = set()
    for out, (m, l, acc), how in seen:
        assert how is not None and how.hadamard == (method == "waterfill") and how.out_dtype == dtype
        assert (how.rotation is not None) == (method == "turboquant_rvq")
        rotate = ((lambda y: rotate_values(y, 0, inverse=True)) if how.hadamard
                  else (lambda y: y @ how.rotation) if how.rotation is not None else None)
        want = merge_partials(m, l, acc, how.sinks, rotate=rotate)
        B, Hk, Rk, dv = want.shape
        assert out.shape == (B, Hk * Rk, 1, dv) and out.dtype == dtype
        assert _rel(out.astype(mx.float32).reshape(B, Hk, Rk, dv), want) < (1e-2 if dtype == mx.bfloat16 else 2e-3)
        splits.add(m.shape[-1])
    assert (max_splits is None) or splits == {max_splits + 1}
    # past FUSED_MAX_S1 partials: the merge kernel (or, for a dense rotation back, the op path's merge)
    assert fused_max is None or min(splits) > fused_max
    assert all(how.owner is c for *_, how in seen)
    counters = c._kernel_counters
    assert counters.dtype == mx.int32 and counters.shape[0] >= H and not np.array(counters).any()


@GPU
@pytest.mark.parametrize("method", ["kivi", "kivi_sink", "waterfill", "turboquant_rvq"])
def test_fused_launches_of_one_cache_evaluated_together_equal_those_evaluated_one_by_one(method):
    """Decode steps whose queries do not come from each other's outputs, evaluated in one ``mx.eval``, give what the
    same steps evaluated one at a time give: the cache's block counters order each launch after the previous one
    (``_common.step_counters``). Without that, CUDA's graph ran them concurrently, both counting in the same
    counters, and a head's merge read another step's partials or never ran (garbage or zeros: session 53, H100)."""
    outs = []
    for together in (False, True):
        rng = np.random.default_rng(5)
        c = {"kivi": lambda: _kivi(64), "kivi_sink": lambda: _kivi_sink(64, bits=2, group=16, sinks=3),
             "turboquant_rvq": lambda: _tq(64),
             "waterfill": lambda: _waterfill(64, nn.RoPE(64, base=10000.0))}[method]()
        f16 = mx.float16
        K, V = c.update_and_fetch(_rows(rng, 2, 300, 64, f16), _rows(rng, 2, 300, 64, f16))
        mx.eval(dispatch.dispatched_sdpa(_rows(rng, 6, 300, 64, f16), K, V, cache=c, scale=0.125, mask="causal"))
        got = []
        for _ in range(8):
            K, V = c.update_and_fetch(_rows(rng, 2, 1, 64, f16), _rows(rng, 2, 1, 64, f16))
            got.append(dispatch.dispatched_sdpa(_rows(rng, 6, 1, 64, f16), K, V, cache=c, scale=0.125, mask=None))
            if not together:
                mx.eval(got[-1])
        mx.eval(got)
        outs.append(mx.stack(got).astype(mx.float32))
    assert float(mx.abs(outs[0]).max()) > 0.05  # attention outputs, not a kernel's untouched zeros
    assert float(mx.abs(outs[0] - outs[1]).max()) <= 1e-3 * float(mx.abs(outs[0]).max()), method


@GPU
def test_decode_steps_take_the_kernels_on_the_gpu():
    """Through the dispatch point, a decode step on the GPU runs the checked kernel (no fallback)."""
    for name, c, D in (("waterfill", _waterfill(64, nn.RoPE(64, base=10000.0)), 64), ("kivi", _kivi(64), 64),
                       ("kivi_sink", _kivi_sink(64), 64), ("turboquant_rvq", _tq(64), 64)):
        rng = np.random.default_rng(1)
        for n in (200, 40):  # a second chunk attends over stored codes (TurboQuant-RVQ: its rows kernel)
            K, V = c.update_and_fetch(_rows(rng, 2, n, D, mx.float16), _rows(rng, 2, n, D, mx.float16))
            mx.eval(dispatch.dispatched_sdpa(_rows(rng, 4, n, D, mx.float16), K, V, cache=c, scale=D**-0.5,
                                             mask="causal"))
        for _ in range(2):
            K, V = c.update_and_fetch(_rows(rng, 2, 1, D, mx.float16), _rows(rng, 2, 1, D, mx.float16))
            mx.eval(dispatch.dispatched_sdpa(_rows(rng, 4, 1, D, mx.float16), K, V, cache=c, scale=D**-0.5,
                                             mask=None))
        assert name in _common._checked and name not in _common._disabled
    # TurboQuant-RVQ's prefill kernels: the chunks' codes and the second chunk's rotated-domain past
    assert {"turboquant_rvq_encode", "turboquant_rvq_rows"} <= _common._checked and not _common._disabled


# ---------------------------------------------------------------------------------------- the kernel path's plumbing
def _split_partials(scores, vals, S):
    """(m, l, acc) of ``S`` splits (the last possibly empty) from scores [B, H, R, n] and values
    [B, H, n, Dv], in MLX ops: what a kernel returns."""
    n = scores.shape[-1]
    per = -(-n // (S - 1)) if S > 1 else n
    ms, ls, accs = [], [], []
    for s in range(S):
        a, b = min(n, s * per), min(n, (s + 1) * per)
        if b > a:
            m = scores[..., a:b].max(axis=-1)
            p = mx.exp(scores[..., a:b] - m[..., None])
            ms.append(m), ls.append(p.sum(axis=-1)), accs.append(p @ vals[:, :, a:b])
        else:
            ms.append(mx.full(scores.shape[:-1], -mx.inf)), ls.append(mx.zeros(scores.shape[:-1]))
            accs.append(mx.zeros((*scores.shape[:-1], vals.shape[-1])))
    return mx.stack(ms, axis=-1), mx.stack(ls, axis=-1), mx.stack(accs, axis=-2)


def _exact_partial(q, exact):
    """(m, l, acc) of the exact rows a decode kernel is handed: e0 rows of k0, e1 of k1, the new row."""
    k0, v0, e0, k1, v1, e1, nk, nv = exact
    f = lambda a: a.astype(mx.float32)  # noqa: E731
    ek = mx.concatenate([f(k0[:, :, :e0]), f(k1[:, :, :e1]), f(nk)], axis=2)
    ev = mx.concatenate([f(v0[:, :, :e0]), f(v1[:, :, :e1]), f(nv)], axis=2)
    return _split_partials(q @ ek.swapaxes(-1, -2), ev, 1)


def _batch_partials(q, kt, vals, exact, counts, q_exact=None):
    """(m, l, acc) of a batch step with per-sequence ``counts`` [B, 5] (``_common.kernel_variants``): sequence b's first
    counts[b, 0] quantized rows (one split), then rows counts[b, 1] .. + counts[b, 2] - 1 of the first exact
    buffer, rows counts[b, 3] .. + counts[b, 4] - 1 of the second, and the new row (scored with ``q_exact`` where
    the quantized rows take other queries: TurboQuant-RVQ's rotated ones)."""
    k0, v0, _, k1, v1, _, nk, nv = exact
    f = lambda a: a.astype(mx.float32)  # noqa: E731
    t, e0, e1 = (np.arange(n)[None] for n in (kt.shape[-1], k0.shape[2], k1.shape[2]))
    seen = np.concatenate([(e0 >= counts[:, 1:2]) & (e0 < counts[:, 1:2] + counts[:, 2:3]),
                           (e1 >= counts[:, 3:4]) & (e1 < counts[:, 3:4] + counts[:, 4:5]),
                           np.ones((len(counts), 1), bool)], 1)
    ek, ev = (mx.concatenate([f(a), f(b), f(c)], 2) for a, b, c in ((k0, k1, nk), (v0, v1, nv)))
    parts = []
    qe = q if q_exact is None else q_exact
    for scores, rows, vis in ((q @ kt, vals, t < counts[:, :1]), (qe @ ek.swapaxes(-1, -2), ev, seen)):
        sc = mx.where(mx.array(vis)[:, None, None], scores, -mx.inf)
        m = sc.max(axis=-1)
        p = mx.exp(sc - mx.where(mx.isinf(m), 0.0, m)[..., None])
        parts.append((m, p.sum(axis=-1), p @ rows))
    (m0, l0, a0), (m1, l1, a1) = parts
    return mx.stack([m0, m1], -1), mx.stack([l0, l1], -1), mx.stack([a0, a1], -2)


@pytest.fixture
def reference_kernels(monkeypatch):
    """Stand-ins for the CUDA kernels computed from the op path's decoded rows (4 splits + the exact
    rows' partial; the merge by ``merge_partials``), and the kernel path switched on: runs every line
    of the kernel path but the CUDA bodies on the CPU (buffers handed over, counts, merge, layout)."""
    from veloxquant_mlx.cache import kernels as kpkg

    monkeypatch.setattr(kpkg, "kernels_enabled", lambda: True)
    caches = {}

    def grouped(queries, scale, H):
        B, Hq, _, D = queries.shape
        return queries.reshape(B, H, Hq // H, D).astype(mx.float32) * scale

    def joined(q, scores, vals, exact):
        qm, ql, qa = _split_partials(scores, vals, 4)
        em, el, ea = _exact_partial(q, exact)
        return (mx.concatenate([qm, em], axis=-1), mx.concatenate([ql, el], axis=-1),
                mx.concatenate([qa, ea], axis=-2))

    def merged(partials, how):  # a fused launch (``merge``) returns the output, else the partials
        return partials if how is None else merge(*partials, *how)

    def wf(queries, scale, k_words, *args, counts=None, merge=None, paired=False):  # paired: how, not what
        c, n, exact = caches["waterfill"], args[-5], args[-1]
        q = grouped(queries, scale, k_words.shape[1])
        vals = c._value_codes(0, n) * c.v_scales[:, :, :n, None].astype(mx.float32)
        if counts is not None:
            caches["waterfill_batch_launches"] = caches.get("waterfill_batch_launches", 0) + 1
            return merged(_batch_partials(q, c._keys(0, n).swapaxes(-1, -2), vals, exact, np.array(counts)), merge)
        return merged(joined(q, q @ c._keys(0, n).swapaxes(-1, -2), vals, exact), merge)

    def kv(queries, scale, k_codes, *args, counts=None, merge=None):
        c, n, exact = caches["kivi"], args[-5], args[-1]
        q = grouped(queries, scale, k_codes.shape[1])
        kt, vals = KIVIKVCache._keys_t(c, n), KIVIKVCache._values(c, n)  # the codes' rows (no variant's lead rows)
        if counts is not None:
            caches["kivi_batch_launches"] = caches.get("kivi_batch_launches", 0) + 1
            return merged(_batch_partials(q, kt, vals, exact, np.array(counts)), merge)
        caches["kivi_codes_read"] = caches.get("kivi_codes_read", []) + [n]
        return merged(joined(q, q @ kt, vals, exact), merge)

    def tq(queries, rotated, scale, k_planes, k_norms, v_planes, v_norms, key_book, value_book, rotation, n, exact,
           counts=None, merge=None):
        """Scores from the rotated queries and the codes decoded in the rotated domain; the value sums left there."""
        c = caches["turboquant_rvq"]
        H = k_planes[0].shape[1]
        caches["turboquant_rvq_launches"] = caches.get("turboquant_rvq_launches", 0) + 1
        f = lambda a: a.astype(mx.float32)  # noqa: E731
        keys = key_book.decode(*c._kq.codes(k_planes[0][:, :, :n], None if k_planes[1] is None
                                            else k_planes[1][:, :, :n])) * f(k_norms[:, :, :n])[..., None]
        vals = value_book.decode(*c._vq.codes(v_planes[0][:, :, :n], None if v_planes[1] is None
                                              else v_planes[1][:, :, :n])) * f(v_norms[:, :, :n])[..., None]
        qr = grouped(rotated, scale, H)
        if counts is not None:
            caches["turboquant_rvq_batch_launches"] = caches.get("turboquant_rvq_batch_launches", 0) + 1
            return merged(_batch_partials(qr, keys.swapaxes(-1, -2), vals, exact, np.array(counts),
                                          grouped(queries, scale, H)), merge)
        qm, ql, qa = _split_partials(qr @ keys.swapaxes(-1, -2), vals, 4)
        em, el, ea = _exact_partial(grouped(queries, scale, H), exact)
        partials = (mx.concatenate([qm, em], -1), mx.concatenate([ql, el], -1), mx.concatenate([qa, ea], -2))
        return merged(partials, merge)

    def merge(m, l, acc, sinks, hadamard, out_dtype, owner, rotation=None):
        rotate = ((lambda y: rotate_values(y, 0, inverse=True)) if hadamard
                  else (lambda y: y @ rotation) if rotation is not None else None)
        out = merge_partials(m, l, acc, sinks, rotate=rotate)
        B, H, R, dv = out.shape
        # the calling cache, whose block counters the launch takes: int32, one per (batch row, KV head)
        counters = _common.step_counters(owner, B * H)
        assert counters.dtype == mx.int32 and counters.shape[0] >= B * H
        return out.reshape(B, H * R, 1, dv).astype(out_dtype)

    def wf_decode(c, n, dtype):  # waterfill's prefill kernels: the op path, counted
        caches["waterfill_rows_launches"] = caches.get("waterfill_rows_launches", 0) + 1
        return tuple(x.astype(dtype) for x in c._decoded(n))

    def wf_encode(c, keys, values, pos0):
        caches["waterfill_encode_launches"] = caches.get("waterfill_encode_launches", 0) + 1
        return c._encoded(keys, values, pos0)

    def kv_decode(c, n, dtype):
        caches["kivi_rows_launches"] = caches.get("kivi_rows_launches", 0) + 1
        return c._keys_t(n).swapaxes(-1, -2).astype(dtype), c._values(n).astype(dtype)

    def rvq_rows(cb, z):  # TurboQuant-RVQ's encode kernel: the op path's codes and norms of the rotated rows, counted
        caches["tq_encode_launches"] = caches.get("tq_encode_launches", 0) + 1
        norm = mx.sqrt(mx.sum(z * z, axis=-1))
        i, j = cb.encode(z / mx.maximum(norm, 1e-30)[..., None])
        return (pack_bits(i, cb.bits1), (pack_bits(j, cb.bits2) if j is not None else None),
                mx.minimum(norm, 65504.0).astype(mx.float16))

    def rvq_rotated(cb, planes, norms, n, dtype, exact=None, at=0):  # the rows kernel (``exact``: rows around them)
        caches["tq_rows_launches"] = caches.get("tq_rows_launches", 0) + 1
        codes = [unpack_bits(p[:, :, :n], b, cb.n_sub) if p is not None else None
                 for p, b in zip(planes, (cb.bits1, cb.bits2))]
        rows = (cb.decode(*codes) * norms[:, :, :n].astype(mx.float32)[..., None]).astype(dtype)
        return rows if exact is None else mx.concatenate([exact[:, :, :at], rows, exact[:, :, at:]], axis=2)

    monkeypatch.setattr(kivi_rows, "decode_rows", kv_decode)
    monkeypatch.setattr(tq_rows, "encode_rows", rvq_rows)
    monkeypatch.setattr(tq_rows, "rotated_rows", rvq_rotated)
    monkeypatch.setattr(wf_kernel, "waterfill_partials", wf)
    monkeypatch.setattr(wf_rows, "decode_rows", wf_decode)
    monkeypatch.setattr(wf_rows, "encode_rows", wf_encode)
    monkeypatch.setattr(kivi_kernel, "kivi_partials", kv)
    monkeypatch.setattr(tq_kernel, "tq_partials", tq)
    monkeypatch.setattr(kpkg, "merge_kernel", merge)
    monkeypatch.setattr(_common, "_checked", set())
    monkeypatch.setattr(_common, "_disabled", set())
    return caches


def _window_steps_match_float64(c, H, R, D, rng, sinks, steps):
    """``steps`` one-row decode steps of a residual-window cache through the dispatch point, each taking the kernel
    path and matching float64 attention over the rows ``update_and_fetch`` returned."""
    for i in range(steps):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        assert c._decode_kernel_ready(q, K, None)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None, sinks=sinks)
        want = _softmax_attention64(q, K, V, D**-0.5, None if sinks is None else np.array(sinks))
        assert _rel(out, want) < TOL_ATTN, i


@pytest.mark.parametrize("R,rope,with_sinks", [(1, None, False), (3, "rope", True), (4, "traditional", True)])
def test_waterfill_kernel_path_plumbing_equals_float64_attention(reference_kernels, R, rope, with_sinks):
    """With reference partials, the kernel path (tables, merge with sinks + window + own row, rotation
    back, GQA layout) gives float64 attention over the stored rows, and passes its first-use check."""
    H, D = 2, 64
    r = None if rope is None else nn.RoPE(D, traditional=rope == "traditional", base=10000.0)
    c = reference_kernels["waterfill"] = _waterfill(D, r)
    rng = np.random.default_rng(R)
    _feed_waterfill(c, H, R, D, 77, rng)
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    _window_steps_match_float64(c, H, R, D, rng, sinks, 20)
    assert "waterfill" in _common._checked and not _common._disabled
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())  # the kernel's tables are counted


@pytest.mark.parametrize("R,with_sinks,opts", [(1, False, {}), (3, True, {}),
                                                (2, True, {"value_codebook_bits": 12, "value_sub_dim": 4})])
def test_turboquant_rvq_kernel_path_plumbing_equals_float64_attention(reference_kernels, R, with_sinks, opts):
    """With reference partials (the codes decoded in the rotated domain, scored with the rotated queries), the kernel
    path -- the rotated queries, the buffers and norms handed over, the exact rows across window compactions, the
    dense rotation back in the merge -- gives float64 attention over the stored rows and passes its first-use check;
    the rotation matrix it builds is counted once among the shared constants."""
    H, D = 2, 64
    c = reference_kernels["turboquant_rvq"] = _tq(D, **opts)
    rng = np.random.default_rng(R)
    _feed_waterfill(c, H, R, D, 77, rng)
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    _window_steps_match_float64(c, H, R, D, rng, sinks, 40)  # 16 + 32 window rows: compactions every 32 steps
    assert reference_kernels["turboquant_rvq_launches"] >= 40
    assert reference_kernels["tq_encode_launches"] >= 4  # keys and values of the prompt and of two compactions
    assert {"turboquant_rvq", "turboquant_rvq_encode"} <= _common._checked and not _common._disabled
    back = c._vq.back  # the matrix back, built by the kernel path, shared by keys and values (one head dim)
    assert back is c._kq.rotation_back() and np.array_equal(np.array(back), np.array(c._vq.rot_t).T)
    shared = {id(a): a for a in c._kq.arrays() + c._vq.arrays()}
    assert id(back) in shared and c.constant_nbytes == sum(a.nbytes for a in shared.values())
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) + c.constant_nbytes


def test_turboquant_rvq_kernel_takes_only_the_layouts_it_reads():
    assert tq_kernel.supported(128, 128, 4, 4, 12, 8, 8)  # the defaults at d 128, 4 query heads per KV head
    assert tq_kernel.supported(64, 64, 8, 4, 12, 8, 8)
    assert not tq_kernel.supported(80, 80, 4, 4, 12, 8, 8)  # head dims multiples of 32
    assert not tq_kernel.supported(128, 128, 4, 4, 12, 2, 8)  # a lane's 4 value channels span two sub-vectors
    assert not tq_kernel.supported(128, 128, 64, 4, 12, 8, 8)  # shared memory past 48 KB
    # the encode kernel: sub-vectors held in registers (<= 32 coordinates), both codebooks in 48 KB
    assert tq_rows.supported(rvq_codebook(128, 4, 12, 0)) and tq_rows.supported(rvq_codebook(64, 32, 8, 0))
    assert not tq_rows.supported(rvq_codebook(128, 64, 8, 0))
    # the rows kernel reads the codebooks from global memory: 256 x 256 centroids of 32 coordinates (69 KB) too
    big = rvq_codebook(64, 32, 16, 0)
    assert not tq_rows.supported(big) and tq_rows.supported(big, rows=True)
    assert not tq_rows.supported(rvq_codebook(128, 64, 8, 0), rows=True)


@pytest.mark.parametrize("R,bits", [(1, 4), (4, 2)])
def test_kivi_kernel_path_plumbing_equals_float64_attention(reference_kernels, R, bits):
    H, D = 2, 64
    c = reference_kernels["kivi"] = _kivi(D, bits, 32)
    rng = np.random.default_rng(bits)
    K, V = c.update_and_fetch(_rows(rng, H, 70, D), _rows(rng, H, 70, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 70, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    for i in range(40):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        assert _rel(out, _softmax_attention64(q, K, V, D**-0.5)) < TOL_ATTN, i
    assert "kivi" in _common._checked and not _common._disabled


@pytest.mark.parametrize("sinks,prompt", [(4, 70), (5, 3)])
def test_kivi_sink_kernel_path_plumbing_equals_float64_attention(reference_kernels, sinks, prompt):
    """KIVI-sink's decode step on KIVI's decode kernel: the codes past the sinks (their count), the sinks and the
    residual as the two exact buffers, the new row; each step equals float64 attention over the stored rows; while
    the first group after the sinks fills, the op path."""
    H, R, D = 2, 3, 64
    c = reference_kernels["kivi"] = _kivi_sink(D, sinks=sinks)
    rng = np.random.default_rng(sinks)
    K, V = c.update_and_fetch(_rows(rng, H, prompt, D), _rows(rng, H, prompt, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, prompt, D), K, V, cache=c, scale=D**-0.5, mask="causal")
    for i in range(40):
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        q = _rows(rng, H * R, 1, D)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
        assert _rel(out, _softmax_attention64(q, K, V, D**-0.5)) < TOL_ATTN, i
    read = reference_kernels["kivi_codes_read"]
    assert len(read) == 40 - max(0, sinks + 32 - prompt)  # a launch a step once codes exist
    assert all(n % 32 == 0 and 0 < n <= c.n_quant for n in read) and c.n_sink == sinks
    assert "kivi_sink" in _common._checked and not _common._disabled


def test_kivi_batch_kernel_path_plumbing_equals_its_op_path(reference_kernels):
    """With reference partials, the batch form's kernel path (per-sequence counts, right-aligned residual, merge)
    equals its op path over ragged sequences, and is taken only with the mask ``make_mask`` made from the step's
    counts: another array mask (a caller's) sends the step to the op path."""
    H, R, D = 2, 3, 64
    c, rng = _kivi_batch(D, H, (66, 130, 5, 0))
    reference_kernels["kivi"] = c
    B, scale = 4, D**-0.5
    for i in range(40):
        mask = c.make_mask(1)  # as the model makes it from the first layer's cache, before the store
        K, V = c.update_and_fetch(_batch_rows(rng, B, H, D), _batch_rows(rng, B, H, D))
        q, call = _batch_rows(rng, B, H * R, D), c._call
        want = c._attend_call(q, call, scale=scale, mask=mask, sinks=None)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=scale, mask=mask)
        assert _rel(out, want) < TOL_ATTN, i
    assert reference_kernels["kivi_batch_launches"] == 40
    assert "kivi_batch" in _common._checked and not _common._disabled
    foreign = c.make_mask(1) | mx.zeros((1,), dtype=mx.bool_)  # equal values, not the mask this cache made
    K, V = c.update_and_fetch(_batch_rows(rng, B, H, D), _batch_rows(rng, B, H, D))
    dispatch.dispatched_sdpa(_batch_rows(rng, B, H * R, D), K, V, cache=c, scale=scale, mask=foreign)
    assert reference_kernels["kivi_batch_launches"] == 40


def _waterfill_batch(H, R, D, rope, lengths, rng, dtype=mx.float32):
    """A waterfill batch cache merged from single caches fed ``lengths`` rows (with their queries: calibrated
    from ``n_calib_tokens`` rows; shorter ones stay uncalibrated and calibrate during the steps)."""
    singles = [_waterfill(D, rope) for _ in lengths]
    for c, n in zip(singles, lengths):
        _feed_waterfill(c, H, R, D, n, rng, dtype)
    return WaterfillKVCache.merge(singles)


def _tq_batch(H, R, D, lengths, rng, dtype=mx.float32, **opts):
    """A TurboQuant-RVQ batch cache merged from single caches fed ``lengths`` rows (ragged; 0: empty)."""
    singles = [_tq(D, **opts) for _ in lengths]
    for c, n in zip(singles, lengths):
        if n:
            _feed_waterfill(c, H, R, D, n, rng, dtype)
    out = TurboQuantRVQKVCache.merge(singles)
    assert type(out) is TurboQuantRVQBatchKVCache
    return out


@pytest.mark.parametrize("method,R,rope,with_sinks", [("waterfill", 1, None, False), ("waterfill", 3, "rope", True),
                                                      ("turboquant_rvq", 1, None, False),
                                                      ("turboquant_rvq", 3, None, True)])
def test_batch_kernel_path_plumbing_equals_its_op_path(reference_kernels, method, R, rope, with_sinks):
    """With reference partials, waterfill's and TurboQuant-RVQ's batch kernel paths (per-sequence code slots, sinks,
    right-aligned window; waterfill's key tables per sequence and head and rotation back, TurboQuant-RVQ's rotated
    queries and dense rotation back) equal their op path over ragged sequences (waterfill's shortest calibrating
    during the steps, windows flushing at different steps), are checked once, and are taken only with the mask
    ``make_mask`` made."""
    H, D, B, scale = 2, 64, 4, 64**-0.5
    rng = np.random.default_rng(R)
    if method == "waterfill":
        c = _waterfill_batch(H, R, D, None if rope is None else nn.RoPE(D, base=10000.0), (77, 300, 40, 5), rng)
    else:
        c = _tq_batch(H, R, D, (77, 300, 40, 0), rng)
    reference_kernels[method] = c
    sinks = mx.array(rng.normal(size=(H * R,)).astype(np.float32)) if with_sinks else None
    for i in range(40):
        mask = c.make_mask(1)
        K, V = c.update_and_fetch(_batch_rows(rng, B, H, D), _batch_rows(rng, B, H, D))
        q, call = _batch_rows(rng, B, H * R, D), c._call
        want = c._attend_op(q, K, V, call, scale=scale, mask=mask, sinks=sinks)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=scale, mask=mask, sinks=sinks)
        assert _rel(out, want) < TOL_ATTN, i
    assert reference_kernels[f"{method}_batch_launches"] == 40 and len(set(c.nq)) == B
    assert f"{method}_batch" in _common._checked and not _common._disabled
    assert method != "waterfill" or all(c.src)
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) + (c.constant_nbytes if method != "waterfill" else 0)
    foreign = c.make_mask(1) | mx.zeros((1,), dtype=mx.bool_)  # equal values, not the mask this cache made
    K, V = c.update_and_fetch(_batch_rows(rng, B, H, D), _batch_rows(rng, B, H, D))
    dispatch.dispatched_sdpa(_batch_rows(rng, B, H * R, D), K, V, cache=c, scale=scale, mask=foreign)
    assert reference_kernels[f"{method}_batch_launches"] == 40


def test_a_mismatching_kernel_is_turned_off_with_one_warning(reference_kernels, monkeypatch):
    """A kernel whose output disagrees with the op path at first use is turned off (one warning) and
    the step's result is the op path's."""
    H, D = 2, 64
    c = reference_kernels["kivi"] = _kivi(D, 4, 32)
    def wrong(queries, scale, k_codes, *args):  # values doubled
        n = args[-5]
        q = queries.reshape(1, H, -1, D).astype(mx.float32) * scale
        qm, ql, qa = _split_partials(q @ c._keys_t(n), 2 * c._values(n), 2)
        em, el, ea = _exact_partial(q, args[-1])
        return (mx.concatenate([qm, em], axis=-1), mx.concatenate([ql, el], axis=-1),
                mx.concatenate([qa, ea], axis=-2))

    monkeypatch.setattr(kivi_kernel, "kivi_partials", wrong)
    rng = np.random.default_rng(3)
    K, V = c.update_and_fetch(_rows(rng, H, 64, D), _rows(rng, H, 64, D))
    K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
    q = _rows(rng, H, 1, D)
    with pytest.warns(RuntimeWarning, match="kivi"):
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask=None)
    assert _rel(out, _softmax_attention64(q, K, V, D**-0.5)) < TOL_ATTN
    assert "kivi" in _common._disabled


@pytest.mark.parametrize("method", ["waterfill", "kivi"])
def test_memoized_dense_rows_stay_the_stored_rows_across_appends_and_trims(reference_kernels, method):
    """On the kernels' backend with the dispatch point installed, ``update_and_fetch`` reuses the lazy
    dense rows of the quantized part between appends: the rows it returns still equal the stored rows
    built afresh, across compactions / group completions and after a trim."""
    H, D, R = 2, 64, 2
    dispatch.install()
    c = reference_kernels[method] = (_waterfill(D, nn.RoPE(D, base=10000.0)) if method == "waterfill"
                                     else _kivi(D, 4, 32))
    rng = np.random.default_rng(11)
    K, V = c.update_and_fetch(_rows(rng, H, 70, D), _rows(rng, H, 70, D))
    dispatch.dispatched_sdpa(_rows(rng, H * R, 70, D), K, V, cache=c, scale=D**-0.5, mask="causal")

    def fresh():
        c._dense_memo.clear()
        return c._dense()

    reused = 0
    for i in range(40):
        if i == 25:
            c.trim(c.n_res + 32 if method == "kivi" else 20)
        K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
        reused += c._dense_memo.key is not None
        call = c._call
        n = call.s0 + call.q0 if method == "waterfill" else call[0]  # sinks + quantized rows at this step
        out = dispatch.dispatched_sdpa(_rows(rng, H * R, 1, D), K, V, cache=c, scale=D**-0.5, mask=None)
        mx.eval(out)
        Kf, Vf = fresh()  # (a step that compacts quantizes more rows after these: compare these only)
        assert bool(mx.array_equal(K[:, :, :n], Kf[:, :, :n].astype(K.dtype))), i
        assert bool(mx.array_equal(V[:, :, :n], Vf[:, :, :n].astype(V.dtype))), i
    assert reused > 20


def test_waterfill_prefill_plumbing_of_the_rows_kernels_equals_the_op_path(reference_kernels, monkeypatch):
    """With the kernels on, quantized rows are encoded and the past decoded through the rows kernels' entry
    points (stand-ins computing the op path from what they are handed: positions, rows, dtype); the rows
    ``update_and_fetch`` returns, the stored codes and each chunk's attention equal those of a cache with the
    kernels off (the final decode step's attention, through the decode kernel's stand-in, to rounding)."""
    from veloxquant_mlx.cache import kernels as kpkg

    H, D, R = 2, 64, 2
    dispatch.install()
    runs = []
    for on in (True, False):
        monkeypatch.setattr(kpkg, "kernels_enabled", lambda on=on: on)
        c = reference_kernels["waterfill"] = _waterfill(D, nn.RoPE(D, base=10000.0))
        rng = np.random.default_rng(9)
        got = []
        for n in (40, 97, 64, 1):
            K, V = c.update_and_fetch(_rows(rng, H, n, D, mx.float16), _rows(rng, H, n, D, mx.float16))
            out = dispatch.dispatched_sdpa(_rows(rng, H * R, n, D, mx.float16), K, V, cache=c, scale=D**-0.5,
                                           mask="causal" if n > 1 else None)
            got += [K, V, out]
        runs.append(got + [c.k_words[:, :, : c.n_quant], c.v_words[:, :, : c.n_quant], c.v_scales[:, :, : c.n_quant]])
    assert reference_kernels["waterfill_encode_launches"] >= 2 and reference_kernels["waterfill_rows_launches"] >= 2
    for i, (a, b) in enumerate(zip(*runs)):
        assert a.dtype == b.dtype, i
        if i == 11:  # the decode step: the decode kernel's stand-in against the op path, to rounding
            assert _rel(a.astype(mx.float32), b.astype(mx.float32)) < 2e-3
        else:
            assert bool(mx.array_equal(a, b)), i


def test_kivi_prefill_plumbing_of_the_rows_kernel_equals_the_op_path(reference_kernels, monkeypatch):
    """With the kernels on, a chunk's dense past comes from the rows kernel's entry point (a stand-in computing
    the op path from the cache it is handed, in the dtype it is asked for): the rows ``update_and_fetch``
    returns equal those of a cache with the kernels off, and a decode step's rows are never asked of it in
    float32."""
    from veloxquant_mlx.cache import kernels as kpkg

    H, D = 2, 64
    runs = []
    for on in (True, False):
        monkeypatch.setattr(kpkg, "kernels_enabled", lambda on=on: on)
        c = reference_kernels["kivi"] = _kivi(D, 4, 32)
        rng = np.random.default_rng(4)
        got = []
        for n in (40, 97, 64, 1):
            got += c.update_and_fetch(_rows(rng, H, n, D, mx.bfloat16), _rows(rng, H, n, D, mx.bfloat16))
        runs.append(got)
    assert reference_kernels["kivi_rows_launches"] >= 3
    for i, (a, b) in enumerate(zip(*runs)):
        assert a.dtype == b.dtype == mx.bfloat16 and bool(mx.array_equal(a, b)), i


@GPU
@pytest.mark.parametrize("H,D,bits,group,prompt,dtype", [
    (2, 64, 4, 32, 45, mx.float16), (8, 128, 4, 32, 3000, mx.bfloat16), (3, 64, 2, 64, 1037, mx.float32),
    (4, 128, 8, 128, 777, mx.float16)])
def test_kivi_rows_kernel_equals_the_op_path(H, D, bits, group, prompt, dtype):
    """The dense rows a GPU prefill chunk attends over, from the kernel and from the op path (float32 out: to
    float32 rounding; the model's dtype: to its rounding)."""
    c = _kivi(D, bits, group)
    rng = np.random.default_rng(prompt)
    c.update_and_fetch(_rows(rng, H, prompt, D, dtype), _rows(rng, H, prompt, D, dtype))
    n = c.n_quant
    assert n > 0 and kivi_rows.supported(bits, group, c.value_group(D), D, D)
    want = (c._keys_t(n).swapaxes(-1, -2), c._values(n))
    for out_dtype, tol in ((mx.float32, 1e-6), (dtype, 1e-2 if dtype == mx.bfloat16 else 2e-3)):
        got = kivi_rows.decode_rows(c, n, out_dtype)
        for g, w in zip(got, want):
            assert g.dtype == out_dtype and g.shape == w.shape
            assert _rel(g.astype(mx.float32), w) < tol


def _kvquant(D, rope=None, **opts):
    """A KVQuant cache of head dim ``D`` (``KVQuantOptions`` fields), keys pre-RoPE when ``rope`` is given."""
    c = KVCacheFactory.create(KVCacheConfig(method="kvquant", head_dim=D, options=KVQuantOptions(**opts)))
    c.bind_attention(type("Attention", (), {"rope": rope})() if rope is not None else None)
    assert (c.rope is None) == (rope is None)
    return c


def _kvquant_stand_ins(monkeypatch):
    """KVQuant's two prefill kernels stood in by the op path (counted: the rows asked, the chunks encoded), the
    encoding's outliers in entry order as the kernel writes them; first-use checks reset."""
    asked, encoded = [], []

    def rows(c, n, dtype):
        asked.append((n, dtype))
        return c._keys_t(n).swapaxes(-1, -2).astype(dtype), c._values(n).astype(dtype)

    def encode(c, kb, vb, t0):
        encoded.append((t0, kb.shape[2]))
        keys, (vidx, vval, vd) = c._encode_keys(kb, t0, t0 // c.group, False), c._split_values(vb)
        return (*keys[:3], *_by_entry(*keys[3:])), (*_by_entry(vidx, vval), vd)

    monkeypatch.setattr(kvquant_rows, "decode_rows", rows)
    monkeypatch.setattr(kvquant_rows, "encode", encode)
    monkeypatch.setattr(_common, "_checked", set())
    monkeypatch.setattr(_common, "_disabled", set())
    return asked, encoded


def test_kvquant_decode_step_on_cuda_attends_over_the_returned_rows(monkeypatch):
    """With the kernels on, a decode step attends over the dense rows ``update_and_fetch`` returned (the rows
    kernel's, stood in by the op path): the same attention as the op path's over the codes, to float32 rounding."""
    from veloxquant_mlx.cache import kernels as kpkg

    from veloxquant_mlx.cache.methods.quantization.kvquant import KVQuantKVCache

    asked, _ = _kvquant_stand_ins(monkeypatch)
    decoded = []  # the steps' key decodings, whoever asks
    keys_t = KVQuantKVCache._keys_t
    monkeypatch.setattr(KVQuantKVCache, "_keys_t", lambda c, n, *a: decoded.append(n) or keys_t(c, n, *a))
    H, R, D = 2, 3, 64
    dispatch.install()
    monkeypatch.setattr(native, "_ENV_ON", False)  # the CPU pass on the op path (not KVQuant's CPU kernel)
    outs, counts = [], []
    for on in (True, False):
        decoded.clear()
        monkeypatch.setattr(kpkg, "kernels_enabled", lambda on=on: on)
        monkeypatch.setattr(blocks, "on_cpu", lambda on=on: not on)  # the kernels run on a GPU
        c = _kvquant(D, nn.RoPE(D, base=10000.0), bits=3, group_size=32, n_sink=1)
        rng = np.random.default_rng(8)
        c.update_and_fetch(_rows(rng, H, 100, D), _rows(rng, H, 100, D))
        got = []
        for _ in range(3):
            K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
            got.append(dispatch.dispatched_sdpa(_rows(rng, H * R, 1, D), K, V, cache=c, scale=D**-0.5, mask=None))
        outs.append(got)
        counts.append(len(decoded))
    # the three steps' rows came from the rows kernel's entry point (plus the op path once: its first-use check),
    # and the attention decoded no keys again (the op path decodes them for the returned rows and for its attention)
    assert len(asked) == 3 and counts == [4, 6]
    for a, b in zip(*outs):
        assert a.shape == (1, H * R, 1, D) and _rel(a, b) < 1e-5


def test_kvquant_prefill_plumbing_of_the_kernels(monkeypatch):
    """With the kernels on, a chunk's rows are coded by ``kvquant_rows.encode`` except on the chunks that fit levels
    (the first; a refit), and its dense past comes from ``kvquant_rows.decode_rows`` in the rows' dtype (stand-ins
    computing the op path from the cache they are handed): the cache's arrays (outliers sorted by entry) and the rows
    it returns equal those of a cache with the kernels off."""
    from veloxquant_mlx.cache import kernels as kpkg

    asked, encoded = _kvquant_stand_ins(monkeypatch)
    H, D = 2, 64
    runs = []
    for on in (True, False):
        monkeypatch.setattr(kpkg, "kernels_enabled", lambda on=on: on)
        c = _kvquant(D, nn.RoPE(D, base=10000.0), bits=3, group_size=16, refit_interval=8, n_sink=2)
        rng = np.random.default_rng(6)
        got = []
        for n in (40, 97, 64, 1, 50):
            got += c.update_and_fetch(_rows(rng, H, n, D, mx.bfloat16), _rows(rng, H, n, D, mx.bfloat16))
        o = c._n_out(D)  # a group's outliers sorted by entry (the op path's come in argpartition's order)
        c.k_oidx, c.k_oval = _by_entry(c.k_oidx.reshape(1, H, -1, o), c.k_oval.reshape(1, H, -1, o))
        c.v_oidx, c.v_oval = _by_entry(c.v_oidx.reshape(1, H, -1, o), c.v_oval.reshape(1, H, -1, o))
        runs.append((got, [getattr(c, f) for f in c.array_fields], list(c.fit_starts)))
    # G = 16: fits at group 0 (the first chunk's 2 groups) and group 8 (the third chunk's 4, 8 groups on); the
    # second chunk's 6 groups (from token 32) and the last one's 3 (from token 192) by the kernel
    assert encoded == [(32, 96), (192, 48)] and runs[0][2] == runs[1][2] == [0, 8]
    assert [n for n, _ in asked] == [32, 128, 192, 192] and {d for _, d in asked} == {mx.bfloat16}
    assert {"kvquant_encode", "kvquant_rows"} <= _common._checked  # first-use checks passed against the op path
    for i, (a, b) in enumerate(zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1])):
        assert (a is None) == (b is None) and (a is None or bool(mx.array_equal(a, b))), i


@GPU
@pytest.mark.parametrize("H,D,bits,group,frac,rope,t0,n,dtype", [
    (2, 64, 3, 32, 0.01, "rope", 64, 96, mx.float16), (8, 128, 3, 32, 0.01, "rope", 2048, 2048, mx.bfloat16),
    (3, 64, 2, 64, 0.02, "traditional", 128, 640, mx.float32), (4, 128, 4, 16, 0.0, None, 32, 160, mx.float16),
    (2, 96, 5, 32, 0.05, "partial", 4000, 256, mx.bfloat16), (1, 32, 8, 8, 0.1, "rope", 8, 64, mx.float16)])
def test_kvquant_encode_kernel_equals_the_op_path(H, D, bits, group, frac, rope, t0, n, dtype):
    """KVQuant's codes of a chunk from the kernel and from the op path (levels fitted on a first chunk): keys' and
    values' outliers (the op path's sorted by entry) and their values equal, ranges and the values' dense rows equal,
    and key codes equal but for an entry at a level's boundary that the RoPE angle's float32 rounding moves (the op
    path sums the angle from per-64-position tables) -- at most a thousandth of them."""
    ropes = {"rope": nn.RoPE(D, base=10000.0), "traditional": nn.RoPE(D, traditional=True, base=500000.0),
             "partial": nn.RoPE(D // 2, base=10000.0), None: None}
    c = _kvquant(D, ropes[rope], bits=bits, group_size=group, outlier_fraction=frac)
    rng = np.random.default_rng(n)
    c.update_and_fetch(_rows(rng, H, t0, D, dtype, 3.0), _rows(rng, H, t0, D, dtype))
    assert c.n_quant == t0 and c.fit_starts == [0] and kvquant_rows.encode_supported(D, D, group, bits)
    kb, vb = (_rows(rng, H, n, D, dtype, 3.0) for _ in range(2))
    kb, vb = (mx.where(mx.abs(x) > 8.0, 40.0 * x, x) for x in (kb, vb))  # a few large outliers
    (gk, gv) = kvquant_rows.encode(c, kb, vb, t0)
    wk, wv = c._encode_keys(kb, t0, t0 // group, False), c._split_values(vb)
    wk, wv = (*wk[:3], *_by_entry(*wk[3:])), (*_by_entry(*wv[:2]), wv[2])
    assert (gk[3] is None) == (gv[0] is None) == (not frac)
    assert gk[0].shape == wk[0].shape and gk[0].dtype == mx.uint32
    unpack = lambda w: unpack_bits(w.reshape(H, D, n // group, -1), bits, group)  # noqa: E731
    assert float((unpack(gk[0]) != unpack(wk[0])).astype(mx.float32).mean()) <= 1e-3
    tol = 4 * (t0 + n) * 2.0**-23  # the angle's rounding, relative
    for a, w in zip((*gk[1:], *gv), (*wk[1:], *wv)):
        if w is not None:
            assert a.shape == w.shape and a.dtype == w.dtype
            assert _rel(a.astype(mx.float32), w.astype(mx.float32)) <= tol


@GPU
@pytest.mark.parametrize("H,D,bits,group,frac,sinks,rope,prompt,dtype", [
    (2, 64, 3, 32, 0.01, 1, "rope", 45, mx.float16), (8, 128, 3, 32, 0.01, 1, "rope", 3000, mx.bfloat16),
    (3, 64, 2, 64, 0.02, 4, "traditional", 1037, mx.float32), (4, 128, 4, 16, 0.0, 0, None, 777, mx.float16),
    (2, 96, 5, 32, 0.05, 3, "partial", 300, mx.bfloat16)])
def test_kvquant_rows_kernel_equals_the_op_path(H, D, bits, group, frac, sinks, rope, prompt, dtype):
    """KVQuant's dense past from the kernel and from the op path: codes straddling words (3 and 5 bits), outliers
    or none, sink rows, RoPE full / traditional / on part of the channels / none. The values to float32 rounding;
    the keys' RoPE angle ``t * omega`` is rounded differently by the op path's tables: to ``n * 2^-22``."""
    ropes = {"rope": nn.RoPE(D, base=10000.0), "traditional": nn.RoPE(D, traditional=True, base=500000.0),
             "partial": nn.RoPE(D // 2, base=10000.0), None: None}
    c = _kvquant(D, ropes[rope], bits=bits, group_size=group, outlier_fraction=frac, n_sink=sinks)
    rng = np.random.default_rng(prompt)
    c.update_and_fetch(_rows(rng, H, prompt, D, dtype, 3.0), _rows(rng, H, prompt, D, dtype))
    n = c.n_quant
    assert n > 0 and kvquant_rows.supported(D, D, c.value_group(D))
    want = (c._keys_t(n).swapaxes(-1, -2), c._values(n))
    angle = n * 2.0**-22 if rope else 0.0
    for out_dtype, tol in ((mx.float32, 1e-6), (dtype, 1e-2 if dtype == mx.bfloat16 else 2e-3)):
        got = kvquant_rows.decode_rows(c, n, out_dtype)
        for g, w, extra in zip(got, want, (angle, 0.0)):
            assert g.dtype == out_dtype and g.shape == w.shape
            assert _rel(g.astype(mx.float32), w) < tol + extra


@pytest.mark.parametrize("method", ["waterfill", "kivi"])
def test_prefill_chunks_leave_no_dense_rows_behind(reference_kernels, method):
    """The memo keeps decode steps' lazy dense rows only: a prefill chunk's rows, evaluated by its attention
    (MLX's fused attention on a GPU), are not held after the chunk -- held, every layer kept its dense past
    until its next append."""
    H, D, R = 2, 64, 2
    dispatch.install()
    c = reference_kernels[method] = (_waterfill(D, nn.RoPE(D, base=10000.0)) if method == "waterfill"
                                     else _kivi(D, 4, 32))
    rng = np.random.default_rng(5)
    gc.collect()
    base = mx.get_active_memory()  # arrays other tests left alive
    for chunk in range(3):
        K, V = c.update_and_fetch(_rows(rng, H, 96, D), _rows(rng, H, 96, D))
        mx.eval(K, V)  # what a dense prefill attention evaluates
        mx.eval(dispatch.dispatched_sdpa(_rows(rng, H * R, 96, D), K, V, cache=c, scale=D**-0.5, mask="causal"))
        dense = K.nbytes + V.nbytes
        del K, V
        memo = c.__dict__.get("_dense_memo")
        assert memo is None or memo.value is None, chunk
        mx.eval(c.held_arrays())
        gc.collect()
        mx.clear_cache()
        held = mx.get_active_memory() - base
        assert held < c.nbytes + dense // 4, (chunk, held, c.nbytes, dense)  # no dense copy of the past
    K, V = c.update_and_fetch(_rows(rng, H, 1, D), _rows(rng, H, 1, D))
    mx.eval(dispatch.dispatched_sdpa(_rows(rng, H * R, 1, D), K, V, cache=c, scale=D**-0.5, mask=None))
    assert c._dense_memo.value is not None  # a decode step's lazy rows are kept (never evaluated)


@pytest.mark.parametrize("S,counters", [(3, True), (3, False), (_common.FUSED_MAX_S1, True)])
def test_launch_routes_fused_and_fallback_calls(S, counters, monkeypatch):
    """``launch`` with ``merge`` (any machine, kernels stood in): up to ``FUSED_MAX_S1`` partials one fused call
    taking the sink logits and the cache's block counters (fresh zeroed ones without), past that the partials
    kernel then ``merge_kernel`` with the sinks, rotation flag and output dtype; no zero fill requested."""
    calls = []

    def fake(fused):
        def run(arrays, scalars, consts, shapes, dtypes, grid, threads, **kw):
            calls.append((fused, arrays, shapes, dtypes, kw))
            return [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
        return run

    kernels = {(False, False): fake(False), (False, True): fake(True)}
    merged = []
    monkeypatch.setattr(_common, "merge_kernel", lambda *a: merged.append(a) or "merged")
    B, H, R, dv = 2, 3, 4, 64
    sinks, cnt = mx.ones((H * R,)), mx.zeros((B * H + 5,), mx.int32)
    owner = SimpleNamespace(_kernel_counters=cnt)  # a cache's stand-in
    merge = _common.Merge(sinks, True, mx.bfloat16, owner if counters else None)
    out = _common.launch(kernels, False, [mx.zeros((1,))], [1], (), B, H, R, S, dv, merge)
    (fused, arrays, shapes, dtypes, kw), = calls
    assert "init_value" not in kw
    if S + 1 > _common.FUSED_MAX_S1:
        assert not fused and out == "merged" and len(arrays) == 1 and dtypes == [mx.float32] * 3
        (m, l, acc, *how), = merged
        assert m.shape == (B, H, R, S + 1) and acc.shape == (B, H, R, S + 1, dv) and how == [sinks, True, mx.bfloat16]
        return
    assert fused and not merged and arrays[1] is sinks and dtypes == [mx.float32, mx.bfloat16]
    assert shapes == [(B * H * R * (S + 1) * (dv + 2),), (B, H * R, 1, dv)] and out.shape == (B, H * R, 1, dv)
    assert arrays[2] is cnt if counters else (arrays[2].shape == (B * H,) and arrays[2].dtype == mx.int32)
    # the owner's next launch takes this one's output as an input it never reads (ordered after it); a first launch
    # an array of the output's dtype (the same compiled variant)
    assert arrays[3].dtype == mx.bfloat16
    if counters:
        assert owner._kernel_after is out
        _common.launch(kernels, False, [mx.zeros((1,))], [1], (), B, H, R, S, dv, merge)
        assert calls[-1][1][2] is cnt and calls[-1][1][3] is out


def test_block_counters_are_held_counted_and_not_copied():
    """The fused kernels' counters are one int32 per (batch row, KV head), made once per cache (a larger batch
    makes larger ones), counted in ``nbytes`` while held, and not carried into a deepcopy."""
    import copy

    c = _kivi(64)
    before = c.nbytes
    cnt = _common.step_counters(c, 6)
    assert cnt.dtype == mx.int32 and cnt.shape == (6,) and _common.step_counters(c, 4) is cnt
    assert c.nbytes == before + 6 * 4
    assert _common.step_counters(c, 9).shape == (9,)
    assert "_kernel_counters" not in copy.deepcopy(c).__dict__
