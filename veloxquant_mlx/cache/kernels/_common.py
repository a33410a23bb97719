"""What the decode kernels share: backend choice, the macro prelude, the split count and the merge of
split-K partials with the exact rows."""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import mlx.core as mx

__all__ = ["kernels_enabled", "merge_partials", "split_count", "cuda_kernel", "PRELUDE", "WARPS",
           "disable", "checked_call"]

WARPS = 4  # warps per block
TOKENS_PER_WARP = 64  # the split count aims at about this many tokens per warp
MAX_SPLITS = 512

# The thin macro layer: kernel bodies use only these names for the backend's primitives (CUDA here).
PRELUDE = r"""
#define VQ_FULL 0xffffffffu
#define VQ_INF __int_as_float(0x7f800000)
#define VQ_LANE ((int)(threadIdx.x & 31))
#define VQ_WARP ((int)(threadIdx.x >> 5))
#define VQ_NTHREADS ((int)blockDim.x)
#define VQ_TID ((int)threadIdx.x)
#define VQ_BLOCK_X ((int)blockIdx.x)
#define VQ_BLOCK_Y ((int)blockIdx.y)
#define VQ_GRID_Y ((int)gridDim.y)
#define VQ_SHFL(v, src) __shfl_sync(VQ_FULL, (v), (src))
#define VQ_SHFL_XOR(v, m) __shfl_xor_sync(VQ_FULL, (v), (m))
#define VQ_SHARED __shared__
#define VQ_SYNC() __syncthreads()
#define VQ_EXP(x) __expf(x)
#define VQ_F(x) static_cast<float>(x)
typedef unsigned int vq_u32;
"""

SELF_CHECK_TOL = 2e-2  # first-use check of a kernel against the op path: relative L2 error
_disabled: set[str] = set()  # kernels turned off in this process (failed to build/run, or mismatched)
_checked: set[str] = set()  # kernels that passed their first-use check in this process


def kernels_enabled() -> bool:
    """True on MLX's CUDA backend (default device the GPU, ``mx.cuda`` available), unless
    ``VELOXQUANT_DECODE_KERNELS=0``."""
    if os.environ.get("VELOXQUANT_DECODE_KERNELS", "1") == "0":
        return False
    if mx.default_device().type != mx.DeviceType.gpu:
        return False
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def disable(name: str, err: Exception) -> None:
    """Turn kernel ``name`` off for this process after a failure (one warning line)."""
    if name not in _disabled:
        _disabled.add(name)
        warnings.warn(f"veloxquant decode kernel {name!r} failed ({type(err).__name__}: {err}); "
                      "using the op path", RuntimeWarning, stacklevel=3)


def checked_call(name: str, cache, kernel_fn: Callable, op_fn: Callable):
    """``kernel_fn()``, the first time in a process evaluated next to ``op_fn()`` (the op path) and
    compared (relative L2 error < ``SELF_CHECK_TOL``): on a build/launch error or a mismatch the
    kernel is turned off with one warning line and the op path's result is used from then on. Both
    functions consume ``cache._call`` (the cache's record of the step), which is restored between."""
    if name in _disabled:
        return op_fn()
    if name in _checked:
        return kernel_fn()
    call = cache._call
    try:
        got = kernel_fn()
        cache._call = call
        want = op_fn()
        mx.eval(got, want)
    except Exception as err:  # noqa: BLE001 -- JIT compile/launch failures surface here: op path from now on
        disable(name, err)
        cache._call = call
        return op_fn()
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    rel = float(mx.linalg.norm((g - w).reshape(-1)) / mx.maximum(mx.linalg.norm(w.reshape(-1)), 1e-30))
    if not rel < SELF_CHECK_TOL:
        disable(name, ValueError(f"relative error {rel:.2e} against the op path"))
        return want
    _checked.add(name)
    return got


def split_count(n_tokens: int) -> int:
    """Splits of the context for split-K: about ``TOKENS_PER_WARP`` tokens per warp (enough blocks to
    fill the GPU at long contexts, few partials at short ones), at most ``MAX_SPLITS``."""
    per_block = WARPS * TOKENS_PER_WARP
    return max(1, min(MAX_SPLITS, -(-n_tokens // per_block)))


_KERNELS: dict[str, object] = {}


def cuda_kernel(name: str, inputs: list[str], outputs: list[str], source: str, header: str = ""):
    """The ``mx.fast.cuda_kernel`` for ``name`` (built once per process)."""
    k = _KERNELS.get(name)
    if k is None:
        k = _KERNELS[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                                 source=source, header=PRELUDE + header)
    return k


def merge_partials(m: mx.array, l: mx.array, acc: mx.array, q: mx.array, ek: Optional[mx.array],
                   ev: Optional[mx.array], sinks: Optional[mx.array] = None,
                   rotate: Optional[Callable[[mx.array], mx.array]] = None) -> mx.array:
    """One softmax over split-K partials of the quantized rows and the exact rows.

    ``m``, ``l`` [B, H, R, S] and ``acc`` [B, H, R, S, Dv] (float32; an empty split has ``m = -inf``,
    ``l = 0``, ``acc = 0``) are the running max, sum of ``exp(s - m)`` and sum of ``exp(s - m) v``
    of each split. ``q`` [B, H, R, D] scaled float32 queries; ``ek``/``ev`` [B, H, E, D/Dv] the exact
    rows (any float dtype; None: none); ``sinks`` [H * R] sink logits or None; ``rotate`` maps the
    quantized part's weighted sum back from a rotated value domain (linear, so it is applied once to
    the merged sum). Returns [B, H, R, Dv] float32."""
    peak = m.max(axis=-1)
    if ek is not None:
        s_e = q @ ek.astype(mx.float32).swapaxes(-1, -2)  # [B, H, R, E]
        peak = mx.maximum(peak, s_e.max(axis=-1))
    B, H, R = peak.shape
    sink = None
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, H, R)
        peak = mx.maximum(peak, sink)
    w = mx.exp(m - peak[..., None])  # [B, H, R, S]
    denom = (w * l).sum(axis=-1)
    out = (w[..., None] * acc).sum(axis=-2)
    if rotate is not None:
        out = rotate(out)
    if ek is not None:
        p = mx.exp(s_e - peak[..., None])
        denom = denom + p.sum(axis=-1)
        out = out + p @ ev.astype(mx.float32)
    if sink is not None:
        denom = denom + mx.exp(sink - peak)
    return out / denom[..., None]


# The end of every decode kernel: the block's warps hold (m[REP], l[REP], acc[REP][VJ]) of their
# token ranges (l already summed over the warp); join them and write the block's partial of split s.
BLOCK_MERGE = r"""
  VQ_SHARED float sm_m[NW * REP];
  VQ_SHARED float sm_l[NW * REP];
  VQ_SHARED float sm_a[NW * REP * DV];
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < REP; ++r) { sm_m[warp * REP + r] = m[r]; sm_l[warp * REP + r] = l[r]; }
  }
#pragma unroll
  for (int r = 0; r < REP; ++r) {
#pragma unroll
    for (int j = 0; j < VJ; ++j) sm_a[(warp * REP + r) * DV + lane + 32 * j] = acc[r][j];
  }
  VQ_SYNC();
  for (int i = VQ_TID; i < REP * DV; i += VQ_NTHREADS) {
    const int r = i / DV, c = i % DV;
    float M = -VQ_INF;
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w * REP + r]);
    float L = 0.f, A = 0.f;
    if (M > -VQ_INF) {
      for (int w = 0; w < NW; ++w) {
        const float e = VQ_EXP(sm_m[w * REP + r] - M);
        L += e * sm_l[w * REP + r];
        A += e * sm_a[(w * REP + r) * DV + c];
      }
    }
    const size_t o = ((size_t)bh * REP + r) * (size_t)S + (size_t)s;
    out_acc[o * DV + c] = A;
    if (c == 0) { out_m[o] = M; out_l[o] = L; }
  }
"""

OUTPUTS = ["out_m", "out_l", "out_acc"]


def launch(kernel, inputs: list, template: list, B: int, H: int, R: int, S: int, dv: int):
    """Run a decode kernel: one block of ``WARPS`` warps per (batch row, KV head) and split."""
    m, l, acc = kernel(inputs=inputs, template=template + [("NW", WARPS), ("REP", R), ("DV", dv)],
                       grid=(32 * WARPS * B * H, S, 1), threadgroup=(32 * WARPS, 1, 1),
                       output_shapes=[(B, H, R, S), (B, H, R, S), (B, H, R, S, dv)],
                       output_dtypes=[mx.float32, mx.float32, mx.float32])
    return m, l, acc
