"""What the decode kernels share: backend choice, the macro prelude, the split count and the merge of
split-K partials with the exact rows."""

from __future__ import annotations

import os
import warnings
from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from ._compile import Kernel, on_metal

__all__ = ["kernels_enabled", "metal_enabled", "shared_limit", "merge_partials", "merge_kernel", "split_count", "WARPS",
           "disable", "checked_call", "Merge"]

WARPS = 4  # warps per block
TOKENS_PER_WARP = 64  # the split count aims at about this many tokens per warp
MAX_SPLITS = 512
# Partials per head up to which a decode step merges in its own launch (past it the one merging block per head is
# slower than merge_kernel's many: docs/RESULTS.md)
FUSED_MAX_S1 = 65

# Exact rows a warp loads at once in a decode kernel (their loads in flight together, then XP softmax updates) when a
# step has more than EXACT_PREFETCH_ROWS exact rows (TurboQuant-RVQ's window); a few dozen rows (KIVI's residual,
# waterfill's window) keep one: prefetching cost them more registers than it saved (docs/RESULTS.md)
EXACT_PREFETCH, EXACT_PREFETCH_ROWS = 4, 64

SELF_CHECK_TOL = 2e-2  # first-use check of a kernel against the op path: relative L2 error
_disabled: set[str] = set()  # kernels turned off in this process (failed to build/run, or mismatched)
_checked: set[str] = set()  # kernels that passed their first-use check in this process


def kernels_enabled() -> bool:
    """True on MLX's CUDA backend (default device the GPU, ``mx.cuda`` available), unless
    ``VELOXQUANT_DECODE_KERNELS=0`` was in the environment when the package was imported. Asked several
    times per decode step and layer: no environment lookup or device query beyond one comparison."""
    if not _ENV_ON or mx.default_device() == _CPU:
        return False
    if not _CUDA:  # asked once per process
        cuda = getattr(mx, "cuda", None)
        _CUDA.append(bool(cuda is not None and cuda.is_available()))
    return _CUDA[0]


def shared_limit() -> int:
    """Bytes of static shared (threadgroup) memory a block may declare: 48 KB on CUDA, 32 KB on Metal."""
    return 32 * 1024 if on_metal() else 48 * 1024


def metal_enabled() -> bool:
    """True on MLX's Metal backend when ``VELOXQUANT_METAL_KERNELS=1`` was in the environment at import (and the
    kernels are not off): KIVI's float32-sum and waterfill's decode kernels, and the encoding kernels ``power_fit``
    and ``vq_nearest``, then run through ``mx.fast.metal_kernel``, each checked once against the op path
    (``checked_call``). Opt-in: it has never run on an Apple GPU, only been
    parsed (``tests/test_metal_source.py``)."""
    return _ENV_ON and _METAL_ON and on_metal()


_ENV_ON = os.environ.get("VELOXQUANT_DECODE_KERNELS", "1") != "0"
_METAL_ON = os.environ.get("VELOXQUANT_METAL_KERNELS", "0") == "1"
_CPU = mx.Device(mx.cpu)
_CUDA: list = []


def disable(name: str, err: Exception) -> None:
    """Turn kernel ``name`` off for this process after a failure (one warning line)."""
    if name not in _disabled:
        _disabled.add(name)
        warnings.warn(f"veloxquant decode kernel {name!r} failed ({type(err).__name__}: {err}); "
                      "using the op path", RuntimeWarning, stacklevel=3)


def checked_call(name: str, cache, kernel_fn: Callable, op_fn: Callable, error: Optional[Callable] = None):
    """``kernel_fn()``, the first time in a process evaluated next to ``op_fn()`` (the op path) and
    compared (``error(got, want)``, default the relative L2 error, < ``SELF_CHECK_TOL``): on a build/launch
    error or a mismatch the kernel is turned off with one warning line and the op path's result is used from
    then on; an error of the op path itself (inconsistent arrays) is raised and leaves the kernel on. Both
    functions consume ``cache._call`` (the cache's record of the step), which is restored between; their results
    are arrays or tuples of arrays."""
    if name in _disabled:
        return op_fn()
    if name in _checked:
        return kernel_fn()
    call = cache._call
    try:
        got = kernel_fn()
    except Exception as err:  # noqa: BLE001 -- JIT compile failures surface here: op path from now on
        disable(name, err)
        cache._call = call
        return op_fn()
    cache._call = call
    want = op_fn()
    mx.eval(want)  # the reference: what it raises is the input's fault (a corrupt state), not the kernel's
    try:
        mx.eval(got)
    except Exception as err:  # noqa: BLE001 -- launch failures
        disable(name, err)
        return want
    rel = (error or relative_error)(got, want)
    if not rel < SELF_CHECK_TOL:
        disable(name, ValueError(f"relative error {rel:.2e} against the op path"))
        return want
    _checked.add(name)
    return got


class _NoRecord:
    """The ``cache`` of a :func:`checked_call` whose functions read no step record (the encoding kernels)."""

    _call = None


def checked_encode(name: str, kernel_fn: Callable, op_fn: Callable, error: Optional[Callable] = None):
    """:func:`checked_call` for a kernel outside a cache's step (``vq_nearest``, ``power_fit``): no record to
    restore."""
    return checked_call(name, _NoRecord(), kernel_fn, op_fn, error)


def relative_error(got, want) -> float:
    """Relative L2 error of ``got`` against ``want`` (the largest over the arrays of a tuple)."""
    if isinstance(got, (tuple, list)):
        return max(relative_error(g, w) for g, w in zip(got, want))
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.linalg.norm((g - w).reshape(-1)) / mx.maximum(mx.linalg.norm(w.reshape(-1)), 1e-30))


def split_count(n_tokens: int) -> int:
    """Splits of the context for split-K: about ``TOKENS_PER_WARP`` tokens per warp (enough blocks to
    fill the GPU at long contexts, few partials at short ones), at most ``MAX_SPLITS``."""
    return max(1, min(MAX_SPLITS, -(-n_tokens // (WARPS * TOKENS_PER_WARP))))


class RowsMemo:
    """The lazily built dense rows of a cache's first ``n`` quantized rows, kept between decode steps
    while nothing is appended (``update_and_fetch`` must return them, but with the dispatch point the
    model's attention never evaluates them: rebuilding their graph of ~20 ops every step and layer is
    host time that the GPU waits for). Cleared by the owner whenever the rows can change (append,
    trim, state load); a deep copy starts empty. On the kernels' backend the graph keeps its small constant
    leaves (a few hundred bytes per layer: tests/test_memory_honesty.py) alive between appends, outside ``nbytes``;
    elsewhere only the grouped layout keeps one, holding no array of its own (``GroupedQuantCache._byte_rows``)."""

    __slots__ = ("key", "value")

    def __init__(self):
        self.key, self.value = None, None

    def get(self, n: int, buf):
        k = self.key
        return self.value if k is not None and k[0] == n and k[1] is buf else None

    def put(self, n: int, buf, value, keep: bool):
        self.key, self.value = ((n, buf), value) if keep else (None, None)
        return value

    def clear(self) -> None:
        self.key, self.value = None, None

    @staticmethod
    def of(cache) -> "RowsMemo":
        """``cache``'s memo (made on first use, kept in ``cache._dense_memo``)."""
        memo = cache.__dict__.get("_dense_memo")
        if memo is None:
            memo = cache._dense_memo = RowsMemo()
        return memo

    @staticmethod
    def forget(cache) -> None:
        """Empty ``cache``'s memo, if it has one (its quantized rows changed)."""
        memo = cache.__dict__.get("_dense_memo")
        if memo is not None:
            memo.clear()

    def fetch(self, n: int, buf, build: Callable, keep: bool):
        """The memoised rows of ``(n, buf)``, else ``build()``; kept only when ``keep`` (a decode step that goes to
        a kernel): any other call leaves the memo empty, so rows a prefill chunk evaluates are never held."""
        out = self.get(n, buf)
        return self.put(n, buf, build() if out is None else out, keep)

    def __deepcopy__(self, memo):
        return RowsMemo()


def merge_partials(m: mx.array, l: mx.array, acc: mx.array, sinks: Optional[mx.array] = None,
                   rotate: Optional[Callable[[mx.array], mx.array]] = None) -> mx.array:
    """One softmax over a decode kernel's split-K partials (MLX ops: the reference of
    :func:`merge_kernel`, and its path where it does not apply).

    ``m``, ``l`` [B, H, R, S + 1] and ``acc`` [B, H, R, S + 1, Dv] (float32) are the running max,
    sum of ``exp(s - m)`` and sum of ``exp(s - m) v`` of each split: S splits of the quantized rows
    (an empty one has ``m = -inf``, ``l = 0``, ``acc = 0``), then the exact rows (never empty: the
    step's own row). ``sinks`` [H * R] sink logits or None; ``rotate`` maps the quantized splits'
    weighted sum back from a rotated value domain (linear: applied once, to the merged sum).
    Returns [B, H, R, Dv] float32."""
    peak = m.max(axis=-1)
    B, H, R = peak.shape
    sink = None
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, H, R)
        peak = mx.maximum(peak, sink)
    w = mx.exp(m - peak[..., None])  # [B, H, R, S + 1]
    denom = (w * l).sum(axis=-1)
    quant = (w[..., :-1, None] * acc[..., :-1, :]).sum(axis=-2)
    if rotate is not None:
        quant = rotate(quant)
    out = quant + w[..., -1:] * acc[..., -1, :]
    if sink is not None:
        denom = denom + mx.exp(sink - peak)
    return out / denom[..., None]


_MERGE_SOURCE = r"""
  // one block per query head: NT = MP * DV threads; thread (part, c) sums the splits s = part (mod MP) of channel c
  const int qh = VQ_BLOCK_X;
  const int tid = VQ_TID;
  constexpr int NT = MP * DV;
  const int c = tid % DV, part = tid / DV;
  const int lane = VQ_LANE, warp = VQ_WARP;
  const float* m = pm + (size_t)qh * S1;
  const float* l = pl + (size_t)qh * S1;
  VQ_SHARED float w[MAX_S1];       // exp(m_s - M) of each split
  VQ_SHARED float red[NT / 32];    // one value per warp
  VQ_SHARED float buf[MP * DV];    // the parts' sums, then the rotation's buffer
  float M = -VQ_INF;
  for (int s = tid; s < S1; s += NT) M = fmaxf(M, m[s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, VQ_SHFL_XOR(M, o));
  if (lane == 0) red[warp] = M;
  VQ_SYNC();
  M = -VQ_INF;
  for (int i = 0; i < NT / 32; ++i) M = fmaxf(M, red[i]);
  float sinkv = 0.f;
  if (HAS_SINK) { sinkv = VQ_F(sk[qh % HQ]); M = fmaxf(M, sinkv); }
  VQ_SYNC();
  float L = 0.f;
  for (int s = tid; s < S1; s += NT) {
    const float e = VQ_EXP(m[s] - M);
    w[s] = e;
    L += e * l[s];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) L += VQ_SHFL_XOR(L, o);
  if (lane == 0) red[warp] = L;
  VQ_SYNC();
  L = 0.f;
  for (int i = 0; i < NT / 32; ++i) L += red[i];
  if (HAS_SINK) L += VQ_EXP(sinkv - M);
  const float* a = pa + (size_t)qh * S1 * DV + c;
  float Aq = 0.f;
#pragma unroll 4
  for (int s = part; s < S1 - 1; s += MP) Aq += w[s] * a[(size_t)s * DV];
  buf[part * DV + c] = Aq;
  VQ_SYNC();
  if (part == 0) {
    for (int p = 1; p < MP; ++p) Aq += buf[p * DV + c];
  }
  if (ROT) {  // fast Walsh-Hadamard transform of the quantized splits' sum (the first DV threads)
    VQ_SYNC();
    if (part == 0) buf[c] = Aq;
    VQ_SYNC();
    for (int h = 1; h < DV; h <<= 1) {
      float x = 0.f, y = 0.f;
      if (part == 0) { x = buf[c]; y = buf[c ^ h]; }
      VQ_SYNC();
      if (part == 0) buf[c] = (c & h) ? (y - x) : (x + y);
      VQ_SYNC();
    }
    Aq = buf[c] * rsqrtf((float)DV);
  }
  if (part == 0) vq_store(out + (size_t)qh * DV + c, (Aq + w[S1 - 1] * a[(size_t)(S1 - 1) * DV]) / L);
"""


_MERGE = Kernel("vq_decode_merge", ["pm", "pl", "pa", "sk"], ["out"], [("S1", "int"), ("HQ", "int")], _MERGE_SOURCE)
MERGE_THREADS = 1024  # at most this many threads per query head in the merge (parts of the splits in parallel)


def merge_kernel(m: mx.array, l: mx.array, acc: mx.array, sinks: Optional[mx.array], hadamard: bool,
                 out_dtype) -> mx.array:
    """:func:`merge_partials` in one CUDA launch: a block per query head, its threads summing the splits in
    up to ``MERGE_THREADS // Dv`` parts (loads in flight, not a loop over every split per thread), the rotation (when
    ``hadamard``) a fast Walsh-Hadamard transform in shared memory; returns [B, H * R, 1, Dv] in ``out_dtype``
    (mlx_lm's layout)."""
    B, H, R, S1, dv = acc.shape
    if S1 > MAX_SPLITS + 1:  # the kernel's shared table holds MAX_SPLITS + 1 split weights
        raise ValueError(f"merge_kernel: {S1} partials, at most MAX_SPLITS + 1 = {MAX_SPLITS + 1}")
    parts = 1  # a power of two up to MERGE_THREADS // Dv, about four splits per part
    while parts * 2 * dv <= MERGE_THREADS and parts * 4 < S1 - 1:
        parts *= 2
    sk = sinks if sinks is not None else m  # any array: not read without sinks
    (out,) = _MERGE([m, l, acc, sk], [S1, H * R],
                    (("DV", dv), ("MP", parts), ("MAX_S1", MAX_SPLITS + 1), ("HAS_SINK", sinks is not None),
                     ("ROT", hadamard)),
                    [(B, H * R, 1, dv)], [out_dtype], grid=(parts * dv * B * H * R, 1, 1), threads=(parts * dv, 1, 1))
    return out


# The counts of a decode step (quantized rows n; first row o and rows e taken of each exact buffer): a single
# cache's scalars, or a batch form's per sequence (``cnt`` int32 [B, 5]; HK KV heads per sequence). The kernel
# bodies hold the marker VQ_COUNTS after ``bh`` is set; :func:`kernel_variants` builds both forms, each returning
# partials or fused.
_COUNTS = {False: "  const int n = n_all, o0 = 0, e0 = e0_all, o1 = 0, e1 = e1_all;",
           True: "  const VQ_DEV int* vq_cnt = cnt + 5 * (bh / HK);\n"
                 "  const int n = vq_cnt[0], o0 = vq_cnt[1], e0 = vq_cnt[2], o1 = vq_cnt[3], e1 = vq_cnt[4];"}

# The start of a decode kernel: its (batch row, KV head) ``bh``, its counts (VQ_COUNTS), its split ``s`` of ``S`` (block
# row S takes the exact rows), the lane and warp.
KERNEL_HEAD = r"""
  const int bh = VQ_BLOCK_X;
VQ_COUNTS
  const int s = VQ_BLOCK_Y;
  const int S1 = VQ_GRID_Y;
  const int S = S1 - 1;  // splits of the quantized rows; block row S takes the exact rows
  const int lane = VQ_LANE, warp = VQ_WARP;
"""

# The exact rows of a decode step (float rows any dtype: e0 rows of x0 from row o0, e1 rows of x1 from row o1,
# then the new row), taken by the blocks of the last split (s == S): their softmax partial, in the original value
# domain, XP rows per warp at a time (``exact_args``). QV(r, j) is the scaled query of head r at the lane's channel
# lane + 32 j.
EXACT_ROWS = r"""
#define VQ_EXACT_LOAD(K, V, ROW) {                                                  \
      const size_t vq_row = (ROW);                                                   \
      _Pragma("unroll") for (int j = 0; j < D / 32; ++j)                             \
        kx[x][j] = VQ_F(K[vq_row * D + lane + 32 * j]);                              \
      _Pragma("unroll") for (int j = 0; j < DV / 32; ++j)                            \
        vx[x][j] = VQ_F(V[vq_row * DV + VQ_VCH(lane, j)]);                           \
    }
    const int E = e0 + e1 + 1;
    for (int e0w = warp * XP; e0w < E; e0w += NW * XP) {  // XP rows per warp at a time: their loads all in flight
      float kx[XP][D / 32], vx[XP][DV / 32];
#pragma unroll
      for (int x = 0; x < XP; ++x) {
        const int e = min(e0w + x, E - 1);  // past the end: the last row again (loaded, never used)
        if (e < e0) VQ_EXACT_LOAD(ek0, ev0, (size_t)bh * T0 + o0 + e)
        else if (e < e0 + e1) VQ_EXACT_LOAD(ek1, ev1, (size_t)bh * T1 + o1 + (e - e0))
        else VQ_EXACT_LOAD(nk, nv, (size_t)bh)
      }
#pragma unroll
      for (int x = 0; x < XP; ++x) {
        if (e0w + x >= E) continue;
        float part[REP];
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          part[r] = 0.f;
#pragma unroll
          for (int j = 0; j < D / 32; ++j) part[r] += QV(r, j) * kx[x][j];
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) part[r] += VQ_SHFL_XOR(part[r], o);
        }
#pragma unroll
        for (int r = 0; r < REP; ++r) {
          const float mn = fmaxf(m[r], part[r]);
          const float corr = VQ_EXP(m[r] - mn);
          const float p = VQ_EXP(part[r] - mn);
          l[r] = l[r] * corr + p;
#pragma unroll
          for (int j = 0; j < DV / 32; ++j) acc[r][j] = acc[r][j] * corr + p * vx[x][j];
          m[r] = mn;
        }
      }
    }
"""

EXACT_INPUTS = ["ek0", "ev0", "ek1", "ev1", "nk", "nv"]
EXACT_SCALARS = [("e0_all", "int"), ("e1_all", "int"), ("T0", "int"), ("T1", "int")]  # rows taken, buffer rows


def kernel_variants(name: str, inputs: list, scalars: list, body: str, bounds=None, prelude: str = "") -> dict:
    """{(batched, fused): Kernel}: the single cache's kernel (counts as scalars) and the batch form's (``cnt``
    input), each returning its partials or, ``fused``, also merging them (``FUSED_TAIL``: the sink logits ``sk`` an
    input, ``HQ`` a scalar) into the attention output: one launch per layer. A fused kernel also takes the block
    counters ``vq_blocks`` and, never read, its cache's previous output ``vq_after`` (``launch``). ``bounds``,
    ``prelude``: ``Kernel``'s."""
    table = {}
    for b in (False, True):
        src = body.replace("VQ_COUNTS", _COUNTS[b])
        ins, sc, nm = inputs + ["cnt"] * b + EXACT_INPUTS, scalars + EXACT_SCALARS, name + ("_batch" if b else "")
        table[b, False] = Kernel(nm, ins, OUTPUTS, sc, src, bounds, prelude)
        table[b, True] = Kernel(nm + "_fused", ins + ["sk", "vq_blocks", "vq_after"], FUSED_OUTPUTS,
                                sc + [("HQ", "int")], FUSED_HEAD + src + FUSED_TAIL, bounds, prelude)
    return table


def window_exact(c, call) -> tuple:
    """``exact`` for a residual-window cache's decode step (``window.WindowCall``): its float16 sinks, the window rows
    stored before the call (the window buffer itself while it still holds them first, else the call's record: a
    compacting call copied them) and the call's own row; with no past window rows any buffer stands in (0 read)."""
    if call.r0 == 0:
        win_k, win_v = c.sink_k, c.sink_v
    elif c.n_quant == call.q0 and c.n_sink == call.s0:
        win_k, win_v = c.win_k, c.win_v
    else:
        win_k, win_v = call.past_k, call.past_v
    return (c.sink_k, c.sink_v, call.s0, win_k, win_v, call.r0, call.new_k, call.new_v)


def exact_args(exact, counts=None, heads: int = 1) -> tuple[list, list, tuple]:
    """The arrays, scalars and constants of ``exact`` = (k0, v0, e0, k1, v1, e1, new_k, new_v) for EXACT_ROWS; a
    batch form passes ``counts`` (int32 [B, 5], first: e0/e1 then unused) and its KV ``heads``."""
    k0, v0, e0, k1, v1, e1, nk, nv = exact
    batched = [counts] if counts is not None else []
    xp = EXACT_PREFETCH if int(e0) + int(e1) > EXACT_PREFETCH_ROWS else 1
    return ([*batched, k0, v0, k1, v1, nk, nv], [int(e0), int(e1), k0.shape[2], k1.shape[2]],
            (("XP", xp),) + ((("HK", heads),) if batched else ()))


# The end of every decode kernel: each warp puts (m, l, acc) of its tokens into shared memory (``sm_m``,
# ``sm_l`` [NW * REP], ``sm_a`` [NW * REP * DV], declared by BLOCK_SHARED; l already summed over the warp),
# then BLOCK_JOIN joins the warps and writes the block's partial of split s.
BLOCK_SHARED = r"""
  VQ_SHARED float sm_m[NW * REP];
  VQ_SHARED float sm_l[NW * REP];
  VQ_SHARED float sm_a[NW * REP * DV];
"""

# A warp's (m, l) of each query head into shared memory (l already summed over the warp)
ML_STORE = r"""
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < REP; ++r) { sm_m[warp * REP + r] = m[r]; sm_l[warp * REP + r] = l[r]; }
    }
"""

# The store for warps holding acc[REP][VJ] at channels VQ_VCH(lane, j) (default lane + 32 j).
LANE_STORE = ML_STORE + r"""#pragma unroll
  for (int r = 0; r < REP; ++r) {
#pragma unroll
    for (int j = 0; j < VJ; ++j) sm_a[(warp * REP + r) * DV + VQ_VCH(lane, j)] = acc[r][j];
  }
"""

# The end of a tensor-core kernel's quantized branch (lane = 4 g + t): l summed over the lanes of one t, then each
# query head 2 t + u's (m, l) and its sums acc[VS][4][4] (an mma's C fragment: row g -> channel VQ_MMA_CH(v, j), row
# g + 8 -> the next one; columns 2 t + u -> heads) into shared memory.
MMA_STORE = r"""
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l2[u] += VQ_SHFL_XOR(l2[u], o);
      const int h = 2 * t + u;
      if (h < REP) {
        if (g == 0) { sm_m[warp * REP + h] = m2[u]; sm_l[warp * REP + h] = l2[u]; }
#pragma unroll
        for (int v = 0; v < VS; ++v)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float* a = sm_a + (warp * REP + h) * DV + VQ_MMA_CH(v, j);
            a[0] = acc[v][j][u];
            a[1] = acc[v][j][2 + u];
          }
      }
    }
"""

BLOCK_JOIN = r"""
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
    const size_t o = ((size_t)bh * REP + r) * (size_t)S1 + (size_t)s;
    out_acc[o * DV + c] = A;
    if (c == 0) { out_m[o] = M; out_l[o] = L; }
  }
"""

BLOCK_MERGE = BLOCK_SHARED + LANE_STORE + BLOCK_JOIN

# A warp's running softmax (m, l, acc [REP][VJ]) started empty, inside a block's branch.
ACC_INIT = r"""    float m[REP], l[REP], acc[REP][VJ];
#pragma unroll
    for (int r = 0; r < REP; ++r) {
      m[r] = -VQ_INF; l[r] = 0.f;
#pragma unroll
      for (int j = 0; j < VJ; ++j) acc[r][j] = 0.f;
    }
"""

# The exact rows' branch of a kernel holding its scaled queries in shared memory (``sq`` [REP, D]: KIVI's and
# TurboQuant-RVQ's): EXACT_ROWS from a fresh softmax, then LANE_STORE.
SQ_EXACT = ACC_INIT + "#define QV(r, j) sq[(r) * D + lane + 32 * (j)]\n" + EXACT_ROWS + LANE_STORE + "\n#undef QV\n"

OUTPUTS = ["out_m", "out_l", "out_acc"]
FUSED_OUTPUTS = ["vq_scratch", "out"]

# A fused kernel's partials live in one float32 scratch output (acc, m, l); its blocks count themselves in
# ``vq_blocks`` (one int per batch row and KV head: ``step_counters``), which each head's last block sets back to zero.
FUSED_HEAD = r"""
#define VQ_PARTIALS (VQ_GRID_X * REP * VQ_GRID_Y)  // (batch row, KV head, query head, split) partials
#define out_acc vq_scratch
#define out_m (vq_scratch + (size_t)VQ_PARTIALS * DV)
#define out_l (out_m + VQ_PARTIALS)
#define vq_done ((int*)vq_blocks)
"""

# The end of a fused kernel: each block, its partial written, counts itself in its (batch row, KV head)'s counter;
# the block that counts last merges that head's S1 partials in one softmax (as merge_partials: sink logits, the
# quantized splits' sum rotated back: ROT 1 a Walsh-Hadamard transform in shared memory (waterfill), ROT 2 times the
# dense matrix a kernel names VQ_VROT (TurboQuant-RVQ)) and writes the
# output [B, H * REP, 1, DV]. The partials are read through L2 (``vq_ldcg``), four channels per load.
FUSED_TAIL = r"""
  VQ_SHARED int vq_last;
  VQ_SHARED float vq_w[REP * 32];
  VQ_FENCE();
  VQ_SYNC();
  if (VQ_TID == 0) {
    vq_last = VQ_ATOMIC_ADD(vq_done + bh, 1) == S1 - 1;
    if (vq_last) vq_done[bh] = 0;  // every block of this head has counted: zero for the next launch
  }
  VQ_SYNC();
  if (vq_last) {
    VQ_FENCE();
    const size_t row0 = (size_t)bh * REP * S1;
    for (int r = warp; r < REP; r += NW) {
      const float* pm = out_m + row0 + (size_t)r * S1;
      const float* pl = out_l + row0 + (size_t)r * S1;
      float M = -VQ_INF;
      for (int i = lane; i < S1; i += 32) M = fmaxf(M, vq_ldcg(pm + i));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, VQ_SHFL_XOR(M, o));
      float sinkv = 0.f;
      if (HAS_SINK) { sinkv = VQ_F(sk[(bh * REP + r) % HQ]); M = fmaxf(M, sinkv); }
      float L = 0.f;
      for (int i = lane; i < S1; i += 32) L += VQ_EXP(vq_ldcg(pm + i) - M) * vq_ldcg(pl + i);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) L += VQ_SHFL_XOR(L, o);
      if (HAS_SINK) L += VQ_EXP(sinkv - M);
      if (lane == 0) { sm_m[r] = M; sm_l[r] = L; }
    }
    VQ_SYNC();
    for (int i = VQ_TID; i < REP * DV; i += VQ_NTHREADS) sm_a[i] = 0.f;
    constexpr int C4 = DV / 4;
    for (int t0 = 0; t0 < S1 - 1; t0 += 32) {  // the quantized splits' weighted sum, 32 splits at a time
      const int nt = min(32, S1 - 1 - t0);
      VQ_SYNC();
      for (int i = VQ_TID; i < REP * 32; i += VQ_NTHREADS) {
        const int r = i / 32, j = i % 32;
        vq_w[i] = j < nt ? VQ_EXP(vq_ldcg(out_m + row0 + (size_t)r * S1 + t0 + j) - sm_m[r]) : 0.f;
      }
      VQ_SYNC();
      for (int i = VQ_TID; i < REP * C4; i += VQ_NTHREADS) {  // 4 channels a thread, 8 loads in flight
        const int r = i / C4, c = 4 * (i % C4);
        const float* pa = out_acc + (row0 + (size_t)r * S1 + t0) * DV + c;
        const float* w = vq_w + r * 32;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 8
        for (int j = 0; j < nt; ++j) {
          const vq_f4 a = vq_ldcg4(pa + (size_t)j * DV);
          a0 += w[j] * a.x; a1 += w[j] * a.y; a2 += w[j] * a.z; a3 += w[j] * a.w;
        }
        float* dst = sm_a + r * DV + c;
        dst[0] += a0; dst[1] += a1; dst[2] += a2; dst[3] += a3;
      }
    }
    if (ROT == 1) {
      for (int hs = 1; hs < DV; hs <<= 1) {
        VQ_SYNC();
        for (int i = VQ_TID; i < REP * DV / 2; i += VQ_NTHREADS) {
          const int r = i / (DV / 2), p = i % (DV / 2);
          float* x = sm_a + r * DV + (p / hs) * 2 * hs + p % hs;
          const float a = x[0], b = x[hs];
          x[0] = a + b;
          x[hs] = a - b;
        }
      }
    }
#ifdef VQ_VROT
    if (ROT == 2) {  // times a dense matrix (the kernel's VQ_VROT, row-major [DV, DV]): y_c = sum_k a_k M[k][c]
      constexpr int NT = 32 * NW, CPT = (DV + NT - 1) / NT;  // columns per thread; one matrix load serves REP rows
      float y[CPT][REP];
      VQ_SYNC();
#pragma unroll
      for (int u = 0; u < CPT; ++u) {
        const int c = VQ_TID + u * NT;
#pragma unroll
        for (int r = 0; r < REP; ++r) y[u][r] = 0.f;
        if (c < DV) {
#pragma unroll 16
          for (int k = 0; k < DV; ++k) {
            const float mk = VQ_F(VQ_VROT[(size_t)k * DV + c]);
#pragma unroll
            for (int r = 0; r < REP; ++r) y[u][r] += sm_a[r * DV + k] * mk;
          }
        }
      }
      VQ_SYNC();
#pragma unroll
      for (int u = 0; u < CPT; ++u) {
        const int c = VQ_TID + u * NT;
        if (c < DV) {
#pragma unroll
          for (int r = 0; r < REP; ++r) sm_a[r * DV + c] = y[u][r];
        }
      }
    }
#endif
    VQ_SYNC();
    const float rot = ROT == 1 ? rsqrtf((float)DV) : 1.f;
    for (int i = VQ_TID; i < REP * DV; i += VQ_NTHREADS) {
      const int r = i / DV, c = i % DV;
      const size_t e = row0 + (size_t)r * S1 + S1 - 1;  // the exact rows' partial
      const float we = VQ_EXP(vq_ldcg(out_m + e) - sm_m[r]);
      const float y = sm_a[r * DV + c] * rot + we * vq_ldcg(out_acc + e * DV + c);
      vq_store(out + ((size_t)bh * REP + r) * DV + c, y / sm_l[r]);
    }
  }
"""


class Merge(NamedTuple):
    """What a fused decode kernel needs to finish the step: the sink logits [H * R] (or None), whether the quantized
    splits' value sum is rotated back from waterfill's Walsh-Hadamard domain, the output's dtype, the calling
    cache (``owner``: the launch takes its block counters, ``step_counters``, and orders its next launch after this
    one; None: fresh zeroed counters, one more queued fill per launch), and a dense matrix that sum is multiplied by
    instead (``rotation`` [Dv, Dv], also the kernel's own ``VQ_VROT`` input)."""

    sinks: Optional[mx.array]
    hadamard: bool
    out_dtype: mx.Dtype
    owner: object = None
    rotation: Optional[mx.array] = None


def step_counters(cache, n: int) -> mx.array:
    """``cache``'s int32 counters [>= n] for its fused decode launches, zero between launches (each head's last block
    sets its counter back), so a step queues no fill for them. Held per cache; two launches must never count in them
    at once, so each launch also takes the cache's previous launch's output as an input it never reads
    (``vq_after``, ``_kernel_after``): MLX's CUDA graph orders a kernel after those that wrote its inputs, and a
    kernel writing an input it was given (the counters) orders nothing. Without it, steps whose queries do not come
    from each other's outputs, evaluated together, ran concurrently and a head's merge read another step's
    partials (H100, session 54; ``mx.depends`` on the counters did not order them). Not state: a deepcopy or a
    reload makes its own; counted in ``nbytes`` (``held_arrays``) while held."""
    c = cache.__dict__.get("_kernel_counters")
    if c is None or c.shape[0] < n:
        c = cache._kernel_counters = mx.zeros((n,), mx.int32)
    return c


def launch(kernels: dict, batched: bool, arrays: list, scalars: list, consts: tuple, B: int, H: int, R: int, S: int,
           dv: int, merge: Optional[Merge] = None, warps: int = WARPS):
    """Run a decode kernel (``kernels`` from :func:`kernel_variants`): one block of ``WARPS`` warps per (batch row,
    KV head) and split, plus one block per (batch row, KV head) for the exact rows. Returns the partials (m, l
    [B, H, R, S + 1], acc [.., Dv]); with ``merge`` the attention output [B, H * R, 1, Dv]: up to ``FUSED_MAX_S1``
    partials per head in the same launch (the partials in a scratch output, the blocks counted in the owner's
    ``step_counters``), past that by :func:`merge_kernel` (the fused tail is one block per head, slower than the
    merge's many when it reads hundreds of partials)."""
    S1 = S + 1
    grid, threads = (32 * warps * B * H, S1, 1), (32 * warps, 1, 1)
    consts = consts + (("NW", warps), ("REP", R), ("DV", dv))
    metal = on_metal()  # Metal: the partials' kernel only, merged by the op path (no cross-block counting there)
    if merge is None or S1 > FUSED_MAX_S1 or metal:
        m, l, acc = kernels[batched, False](arrays, scalars, consts, [(B, H, R, S1), (B, H, R, S1), (B, H, R, S1, dv)],
                                           [mx.float32] * 3, grid=grid, threads=threads)
        if merge is None:
            return m, l, acc
        if merge.rotation is None and not metal:
            return merge_kernel(m, l, acc, *merge[:3])
        rotate = ((lambda y: y @ merge.rotation) if merge.rotation is not None  # no dense rotation in the kernel
                  else (lambda y: mx.hadamard_transform(y, scale=dv ** -0.5)) if merge.hadamard else None)
        return merge_partials(m, l, acc, merge.sinks, rotate=rotate).reshape(B, H * R, 1, dv).astype(merge.out_dtype)
    sk = merge.sinks if merge.sinks is not None else arrays[0]  # any array: not read without sinks
    cnt = step_counters(merge.owner, B * H) if merge.owner is not None else mx.zeros((B * H,), mx.int32)
    after = merge.owner.__dict__.get("_kernel_after") if merge.owner is not None else None
    if after is None:  # a first launch: any array of the output's dtype (one compiled variant either way)
        after = mx.zeros((1,), merge.out_dtype)
    _, out = kernels[batched, True](arrays + [sk, cnt, after], scalars + [H * R],
                                    consts + (("HAS_SINK", merge.sinks is not None),
                                              ("ROT", 2 if merge.rotation is not None else int(merge.hadamard))),
                                    [(B * H * R * S1 * (dv + 2),), (B, H * R, 1, dv)], [mx.float32, merge.out_dtype],
                                    grid=grid, threads=threads)
    if merge.owner is not None:  # the owner's next launch reads it: ordered after this one (step_counters)
        merge.owner._kernel_after = out
    return out
