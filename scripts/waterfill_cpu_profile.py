"""Where one waterfill layer's decode step goes on the default device (the CPU's op path), piece by piece, beside
mlx_lm's plain cache: the fused attention over float rows, the keys' decoding (byte pairs, their gather, the
shift/mask/scale), RoPE re-applied, the score matmuls and the value sum. SmolLM2's attention shape by default.

    python scripts/waterfill_cpu_profile.py --context 8192
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch  # noqa: E402
from veloxquant_mlx.cache.options import WaterfillOptions  # noqa: E402
from veloxquant_mlx.cache.primitives.rope import angle_tables, rope_halves, rotate_parts  # noqa: E402
from veloxquant_mlx.cache.primitives.varpack import _byte_pairs, _pair_dequantize  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median ms of ``mx.eval(fn())``."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--rep", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    H, R, D, T = a.heads, a.rep, a.dim, a.context
    dispatch.install()
    k, v = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D), key=mx.random.key(1))
    q = mx.random.normal((1, H * R, 1, D), key=mx.random.key(2))
    wf = KVCacheFactory.create(KVCacheConfig(method="waterfill", bit_width_inlier=4, head_dim=D,
                                             options=WaterfillOptions(residual_length=16)))
    wf.bind_attention(type("Attn", (), {"rope": nn.RoPE(D, traditional=False, base=1e4)})())
    plain = KVCache()
    for c in (wf, plain):
        for s in range(0, T, 1024):
            K, V = c.update_and_fetch(k[:, :, s:s + 1024], v[:, :, s:s + 1024])
            qc = mx.random.normal((1, H * R, K.shape[2] - s, D))
            mx.eval(dispatch.dispatched_sdpa(qc, K, V, cache=c, scale=D ** -0.5, mask="causal"))
    K, V = plain.keys[:, :, :T], plain.values[:, :, :T]
    n, qg = wf.n_quant, q.reshape(1, H, R, D)
    t = functools.partial(timed, repeats=a.repeats)
    rows = [("plain: fused sdpa over float32 rows", t(lambda: mx.fast.scaled_dot_product_attention(
        q, K, V, scale=D ** -0.5))),
        ("plain: q K^T, softmax, p V as matmuls", t(lambda: mx.softmax(qg @ K.swapaxes(-1, -2), axis=-1) @ V))]
    byte, shift, mask = wf._pair_table()
    by = mx.view(mx.contiguous(wf.k_words[:, :, :n]), mx.uint8)
    pairs = _byte_pairs(by, mx.pad(by[..., 1:], [(0, 0)] * 3 + [(0, 1)]))
    gathered = mx.take_along_axis(pairs, byte, axis=-1)
    lo, st = wf.k_lo.astype(mx.float32), wf.k_step.astype(mx.float32)
    pre = wf._pre_keys(0, n)
    mx.eval(by, pairs, gathered, pre)
    rows += [("waterfill keys: byte pairs", t(lambda: _byte_pairs(by, mx.pad(by[..., 1:], [(0, 0)] * 3 + [(0, 1)])))),
             ("waterfill keys: gather of each code's pair", t(lambda: mx.take_along_axis(pairs, byte, axis=-1))),
             ("waterfill keys: shift, mask, lo + code * step", t(lambda: _pair_dequantize(gathered, shift, mask, lo,
                                                                                             st))),
             ("waterfill keys: all of the decoding", t(lambda: wf._pre_keys(0, n))),
             ("waterfill RoPE: angle tables", t(lambda: angle_tables(wf._omega(), wf.n_sink, n))),
             ("waterfill RoPE: tables and rotation", t(lambda: rotate_parts(pre, wf.rope, wf._omega(), wf.n_sink))),
             ("waterfill scores (decode + RoPE + matmuls)", t(lambda: wf._key_scores(qg, 0, n)))]
    first, second, _ = rope_halves(wf.rope)
    h = D // 2  # the halves' tables, for one compiled function doing a half's decoding and the rotation
    tabs = [x[..., :h] for x in (byte, shift, mask, lo, st)] + [x[..., h:] for x in (byte, shift, mask, lo, st)]
    cos, sin = angle_tables(wf._omega(), wf.n_sink, n)
    mx.eval(*tabs, cos, sin)

    @functools.partial(mx.compile, shapeless=True)
    def decode_and_turn(ga, gb, sa, ma, la, ta, sb, mb, lb, tb, c, s):
        x = la + ((ga >> sa) & ma).astype(mx.float32) * ta
        y = lb + ((gb >> sb) & mb).astype(mx.float32) * tb
        return x * c - y * s, x * s + y * c

    def fused():
        ga, gb = mx.take_along_axis(pairs, tabs[0], axis=-1), mx.take_along_axis(pairs, tabs[5], axis=-1)
        return decode_and_turn(ga, gb, *tabs[1:5], *tabs[6:], cos, sin)
    rows.append(("(gathers + one compiled decode-and-RoPE function)", t(fused)))
    p = mx.softmax(wf._key_scores(qg, 0, n), axis=-1)
    mx.eval(p)
    rows += [("waterfill value sum", t(lambda: wf._weighted_values(p, 0, n))),
             ("(matmul on decoded keys, no RoPE)", t(lambda: qg @ pre.swapaxes(-1, -2)))]
    print(f"device {mx.default_device()}, context {T} ({n} quantized rows), H={H} x {R} query heads, D={D}; "
          f"ms per layer, median of {a.repeats}")
    for name, ms in rows:
        print(f"  {name:48s} {ms:7.3f}")


if __name__ == "__main__":
    main()
