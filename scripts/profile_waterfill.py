"""Per-piece timing of waterfill's decode attention on the current device (one layer, one decode step),
next to MLX's fused attention over a plain cache of the same rows; on MLX's CUDA backend also the
fused decode kernel (``veloxquant_mlx.cache.kernels``) and KIVI's, against their op paths.

    python scripts/profile_waterfill.py --context 8192 --heads 8 --rep 4 --dim 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory  # noqa: E402
from veloxquant_mlx.cache.kernels import kernels_enabled  # noqa: E402
from veloxquant_mlx.cache.methods.quantization.turboquant_rvq import ResidualWindowCache  # noqa: E402
from veloxquant_mlx.cache.methods.quantization.waterfill import _dequantize  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, WaterfillOptions  # noqa: E402

CHUNK = 4096  # prefill chunk (the op path's prefill attention holds a [chunk, context] score matrix)


def fill(c, k, v, q):
    """Prefill ``c`` in chunks through its attention (waterfill calibrates on the first chunk's queries)."""
    for a in range(0, k.shape[2], CHUNK):
        b = min(k.shape[2], a + CHUNK)
        K, V = c.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
        mx.eval(c.attend(q[:, :, a:b], K, V, scale=k.shape[-1] ** -0.5, mask="causal"), c.held_arrays())


def timed(f, reps=20):
    for _ in range(3):
        mx.eval(f())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(f())
    return (time.perf_counter() - t) / reps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--rep", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4)
    a = ap.parse_args(argv)
    T, H, R, D = a.context, a.heads, a.rep, a.dim
    dt = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    c = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=a.bits, head_dim=D,
                                            options=WaterfillOptions(residual_length=16)))
    c.bind_attention(type("Attn", (), {"rope": nn.RoPE(D, traditional=False, base=1e4)})())
    k, v = mx.random.normal((1, H, T, D)).astype(dt), mx.random.normal((1, H, T, D)).astype(dt)
    q = mx.random.normal((1, H * R, T, D)).astype(dt)
    fill(c, k, v, q)
    n, lay = c.n_quant, c._layout_of()
    words = c.k_words[:, :, :n]
    lo, hi = lay.gather(words)
    shift, mask = lay.shift[:, None].astype(mx.uint32), lay.mask[:, None].astype(mx.uint32)
    klo, kst = c.k_lo.astype(mx.float32), c.k_step.astype(mx.float32)
    pre = _dequantize(lo, hi, shift, mask, klo, kst)
    keys = c._keys(0, n)
    qq = mx.random.normal((1, H, R, D))
    p = mx.softmax(mx.random.normal((1, H, R, n)), axis=-1)
    mx.eval(lo, hi, pre, keys)
    one_q = mx.random.normal((1, H * R, 1, D)).astype(dt)
    rows = {
        "gather (2 take_along_axis)": lambda: lay.gather(words),
        "dequantize (compiled)": lambda: _dequantize(lo, hi, shift, mask, klo, kst),
        "rotate_rows (RoPE)": lambda: c._post_rope(pre, c.n_sink),
        "keys total": lambda: c._keys(0, n),
        "q @ K^T": lambda: qq @ keys.swapaxes(-1, -2),
        "value codes (unpack + poly)": lambda: c._value_codes(0, n),
        "quantized part (scores + values)": lambda: c._quantized_part(qq, n)[1](p),
        "whole decode step (store + attend)": None,
        "fused sdpa, plain rows": lambda: mx.fast.scaled_dot_product_attention(one_q, k, v, scale=D**-0.5),
    }

    def step(cache, op=None):
        def run():
            K, V = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
            return (op or cache.attend)(one_q, K, V, scale=D**-0.5, mask=None)
        return run

    rows["whole decode step (store + attend)"] = step(c, lambda *a, **kw: ResidualWindowCache.attend(c, *a, **kw))
    if kernels_enabled():
        rows["whole decode step, fused kernel"] = step(c)
        kv = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=a.bits, head_dim=D,
                                                 options=KIVIOptions(group_size=32)))
        fill(kv, k, v, q)

        def kivi_op(*args, **kw):
            kv.attend_path = "dequant"
            try:
                return kv.attend(*args, **kw)
            finally:
                kv.attend_path = "auto"

        rows["kivi decode step, op path (dequant)"] = step(kv, kivi_op)
        rows["kivi decode step, fused kernel"] = step(kv)
        from veloxquant_mlx.cache import kernels as kpkg
        from veloxquant_mlx.cache.kernels import kivi as kivi_k

        nk, nv = k[:, :, :1], v[:, :, :1]
        exact = (kv.res_k, kv.res_v, kv.n_res, kv.res_k, kv.res_v, 0, nk, nv)

        def kivi_only():
            m, l, acc = kivi_k.kivi_partials(one_q, D**-0.5, kv.k_codes, kv.k_scales, kv.k_biases, kv.v_codes,
                                             kv.v_scales, kv.v_biases, kv.n_quant, kv.qbits, kv.group,
                                             kv.value_group(D), exact)
            return kpkg.merge_kernel(m, l, acc, None, hadamard=False, out_dtype=one_q.dtype)

        rows["kivi kernel only (partials + merge)"] = kivi_only
        rows["kivi kernel x10 in one eval"] = lambda: [kivi_only() for _ in range(10)]
        rows["fused sdpa x10 in one eval"] = lambda: [mx.fast.scaled_dot_product_attention(
            one_q, k, v, scale=D**-0.5) for _ in range(10)]
    print(f"device {mx.default_device()}, T={T}, H={H}, rep={R}, D={D}, {a.bits}-bit")
    for name, f in rows.items():
        print(f"{name:36s} {timed(f):8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
