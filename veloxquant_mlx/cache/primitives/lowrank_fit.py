"""Low-rank fitting and latent-channel coding of the low-rank caches (``svdq``, ``palu``, ``kvtc``). A latent
channel's width is 0 (dropped), 16 (float16) or a ``groupquant`` width; channels sort by decreasing width, each run
of equal widths is quantized along tokens in groups of ``G``, and a token group's words of all runs form one row, so
whole groups append by rows (axis 2).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import groupquant as gq

FLOAT_BITS = 16  # a latent channel stored as float16


def group_heads(x: mx.array, n_groups: int) -> mx.array:
    """[B, H, T, D] -> [B, Hg, T, s*D] (heads h = g*s + j concatenated in order j)."""
    B, H, T, D = x.shape
    s = H // n_groups
    return x.reshape(B, n_groups, s, T, D).transpose(0, 1, 3, 2, 4).reshape(B, n_groups, T, s * D)


def ungroup_heads(x: mx.array, n_heads: int) -> mx.array:
    """Inverse of ``group_heads``: [B, Hg, T, s*D] -> [B, H, T, D]."""
    B, Hg, T, F = x.shape
    s = n_heads // Hg
    return x.reshape(B, Hg, T, s, F // s).transpose(0, 1, 3, 2, 4).reshape(B, n_heads, T, F // s)


def fit_basis(x: mx.array, center: bool = False):
    """Principal directions of the rows of ``x [B, Hg, T, F]`` (eigenvectors of ``XᵀX``, of the covariance with
    ``center``): float32 ``(basis [B, Hg, F, F]`` by decreasing energy, ``energy [B, Hg, F]``, ``mean [B, Hg, 1,
    F]`` or None)."""
    x = x.astype(mx.float32)
    mean = x.mean(axis=2, keepdims=True) if center else None
    x = x - mean if center else x
    w, v = mx.linalg.eigh(x.swapaxes(-1, -2) @ x, stream=mx.cpu)  # ascending; MLX's eigh is CPU-only
    return v[..., ::-1], mx.maximum(w[..., ::-1], 0.0), mean


#: subspace iterations of ``power_lowrank``: at rank 4 of [32, 64] blocks they capture 0.98 (a noise-like residual)
#: to 0.995 (one with structure) of the energy an exact SVD captures (3: 0.92 to 0.98; 16: 0.99 to 0.997). GEAR's
#: KLD on SmolLM2 (``veloxquant eval --task kld --context 512,2048 --n-score 32 --method gear``): exact SVD 0.0853 /
#: 0.0543, 8 iterations 0.0903 / 0.0552, 3 iterations 0.1067 / 0.0644
POWER_ITERS = 8


#: a column whose part outside the earlier columns is below this fraction of its length is taken as in their span
#: and set to 0: float32 rounding leaves ~1e-6 of it there, and normalizing that noise gave an exact rank-2 matrix
#: a rank-16 fit 8.7x its size off (session 36); a real column this short holds < 1e-8 of its energy
DEPENDENT_TOL = 1e-4


def orthonormal_columns(y: mx.array) -> mx.array:
    """Columns of ``y [..., m, r]`` made orthonormal, one at a time (classical Gram-Schmidt, twice per column for
    round-off: "CGS2"); a column in the span of the previous ones (``DEPENDENT_TOL``) becomes 0. A loop over the r
    columns, not rows."""
    q = None
    for j in range(y.shape[-1]):
        v = y[..., j : j + 1]
        length = mx.sqrt((v * v).sum(axis=-2, keepdims=True))
        if q is not None:
            for _ in range(2):
                v = v - q @ (q.swapaxes(-1, -2) @ v)
        norm = mx.sqrt((v * v).sum(axis=-2, keepdims=True))
        v = mx.where(norm > DEPENDENT_TOL * length, v / mx.maximum(norm, 1e-30), 0.0)
        q = v if q is None else mx.concatenate([q, v], axis=-1)
    return q


def power_lowrank(x: mx.array, rank: int, iters: int | None = None, seed: int = 0):
    """A rank-``rank`` fit ``a @ bt`` of each matrix of ``x [..., m, n]`` (float32) by subspace iteration from a
    fixed Gaussian start (Halko, Martinsson & Tropp, arXiv 0909.4061, Alg. 4.4; GEAR's power-iteration solver):
    ``a [..., m, r]`` orthonormal columns spanning ``(x xᵀ)^iters x Ω``, ``bt = aᵀ x [..., r, n]``. Matrix products
    only (MLX's SVD is CPU-only): on a GPU no host sync, on the CPU ~5x faster than ``mx.linalg.svd`` on GEAR's
    blocks; on CUDA one launch for all the matrices (``kernels.power_fit``). Not the exact best fit (Eckart–Young):
    see ``POWER_ITERS``."""
    omega = mx.random.normal((x.shape[-1], rank), key=mx.random.key(seed))
    iters = POWER_ITERS if iters is None else iters
    if _fit_kernel_applies(x, rank):  # one launch for all the matrices (kernels.power_fit; CUDA, Metal opt-in)
        from ..kernels import power_fit
        return power_fit.checked_fit(x, omega, iters, lambda: _power_ops(x, omega, iters))
    return _power_ops(x, omega, iters)


def _fit_kernel_applies(x: mx.array, rank: int) -> bool:
    from ..kernels import kernels_enabled, metal_enabled, power_fit
    return (kernels_enabled() or metal_enabled()) and power_fit.supported(x.shape[-2], x.shape[-1], rank)


def _power_ops(x: mx.array, omega: mx.array, iters: int):
    """``power_lowrank`` with MLX ops: the kernel's reference, and the path wherever it does not run. (Inside
    ``mx.compile`` it took 2.5 ms instead of 4.8 for 512 blocks on an H100, 5.7 instead of 6.6 for 96 on the CPU, but
    the compile cache keeps constants per block shape alive outside any cache's ``nbytes``: not taken.)"""
    y = x @ omega
    for _ in range(iters):
        y = x @ (x.swapaxes(-1, -2) @ orthonormal_columns(y))
    a = orthonormal_columns(y)
    return a, a.swapaxes(-1, -2) @ x


def fit_energies(x: mx.array, bt: mx.array) -> mx.array:
    """Energy of each component of a fit ``a @ bt`` of ``x [..., m, n]`` with orthonormal ``a`` (``|bt_j|^2``, in
    the fit's order), then the rest of ``|x|^2``: ``[..., r + 1]``, for ``energy_rank`` without a decomposition."""
    parts = (bt * bt).sum(axis=-1)
    rest = mx.maximum((x * x).sum(axis=(-2, -1)) - parts.sum(axis=-1), 0.0)
    return mx.concatenate([parts, rest[..., None]], axis=-1)


def captured_energy(energy: mx.array, rank: int) -> mx.array:
    """Fraction of the energy in the first ``rank`` components, per (batch, group)."""
    return energy[..., :rank].sum(axis=-1) / mx.maximum(energy.sum(axis=-1), 1e-30)


def energy_rank(energy: mx.array, threshold: float) -> int:
    """Smallest r whose first r components hold >= ``threshold`` of the energy in every (batch, group)."""
    e = np.asarray(energy.astype(mx.float32)).reshape(-1, energy.shape[-1]).astype(np.float64)
    frac = np.cumsum(e, axis=-1) / np.maximum(e.sum(axis=-1, keepdims=True), 1e-30)
    r = (frac < threshold - 1e-9).sum(axis=-1) + 1  # the 1e-9: round-off at threshold 1.0
    return int(min(max(int(r.max()), 1), e.shape[-1]))


def dp_allocate(distortion, choices, cost, budget: float, lam: float = 0.0, unit: float = 1.0):
    """The C widths (of the K ``choices``) minimising ``sum_c distortion[c, k_c] + lam * sum_c cost[k_c]``
    subject to ``sum_c cost[k_c] <= budget`` (costs in bits, multiples of ``unit``): a multiple-choice knapsack
    by dynamic programming over (component, budget used), vectorised over the budget axis. That axis steps by the
    costs' greatest common divisor in units (kvtc at G = 32: rates b + 1 bits in units of 1/32, all multiples of 32),
    a table equal to the unit-step one at every point a choice reaches, so the same widths, 32x faster there."""
    d = np.asarray(distortion, dtype=np.float64)
    C, K = d.shape
    w = np.rint(np.asarray(cost, dtype=np.float64) / unit).astype(np.int64)
    cap = int(np.floor(budget / unit + 1e-9))
    if cap < 0:
        raise ValueError(f"budget {budget} < 0")
    step = int(np.gcd.reduce(w[w > 0])) if (w > 0).any() else 1
    w, cap = w // step, cap // step
    d = d + lam * np.asarray(cost, dtype=np.float64)[None]
    best = np.zeros(cap + 1)  # best[u] = min distortion of components processed so far using <= u units
    choice = np.zeros((C, cap + 1), dtype=np.int16)
    fits = np.nonzero(w <= cap)[0]
    if not len(fits):
        raise ValueError(f"budget {budget} cannot cover {C} components with costs {list(cost)}")
    cand = np.full((len(fits), cap + 1), np.inf)  # cand[j, u]: component c at width fits[j], the rest before it
    for c in range(C):  # fit time only; vectorised over the widths and the budget axis
        for j, k in enumerate(fits):
            cand[j, w[k]:] = best[: cap + 1 - w[k]] + d[c, k]
        arg = cand.argmin(axis=0)  # ties: the first width listed, as a strict `<` scan
        new = cand[arg, np.arange(cap + 1)]
        if not np.isfinite(new[cap]):
            raise ValueError(f"budget {budget} cannot cover {C} components with costs {list(cost)}")
        best, choice[c] = new, fits[arg]
    out, u = [0] * C, cap
    for c in range(C - 1, -1, -1):
        k = int(choice[c, u])
        out[c], u = int(choices[k]), u - int(w[k])
    return out


@dataclass(frozen=True)
class LatentLayout:
    """Widths of the kept latent channels (non-increasing; 16 = float16) and the token group."""

    bits: tuple
    group: int

    def __post_init__(self):
        b = list(self.bits)
        if not b or any(x <= 0 for x in b) or b != sorted(b, reverse=True):
            raise ValueError(f"latent bits must be positive and non-increasing, got {b}")

    rank = property(lambda self: len(self.bits))
    n_float = property(lambda self: self.bits.count(FLOAT_BITS))
    n_quant = property(lambda self: self.rank - self.n_float)
    words = property(lambda self: sum(s[4] - s[3] for s in self.segments()), doc="uint32 words per token group.")

    def segments(self):
        """(bits, first channel, end channel, first word, end word) of each quantized run of equal widths."""
        out, c0, w0 = [], 0, 0
        for b, run in itertools.groupby(self.bits):
            c1 = c0 + len(list(run))
            if b != FLOAT_BITS:
                out.append((b, c0, c1, w0, w0 + (c1 - c0) * gq.words_per_group(b, self.group)))
                w0 = out[-1][4]
            c0 = c1
        return out

    def bytes_per_token(self) -> float:
        """Stored bytes per token per (batch, group): codes + float16 scale/bias + float16 channels."""
        return (4 * self.words + 4 * self.n_quant) / self.group + 2 * self.n_float


def _cat(xs, axis=-1):
    return xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=axis)


def encode_latents(z: mx.array, layout: LatentLayout):
    """Quantize latents ``z [B, Hg, n, r]`` (n a multiple of G): ``(codes [B, Hg, n/G, W] uint32, scales and
    biases [B, Hg, n/G, r_q] float16, raw [B, Hg, n, r_f] float16)``, None for empty parts. The float16
    channels (width 16 sorts first) are ``[0, r_f)``."""
    B, Hg, n, _ = z.shape
    G, nf = layout.group, layout.n_float
    raw = z[..., :nf].astype(mx.float16) if nf else None
    codes, scales, biases = [], [], []
    zt = z.swapaxes(-1, -2)  # [B, Hg, r, n]
    for b, c0, c1, _, _ in layout.segments():
        q = gq.quantize(zt[:, :, c0:c1], b, G)  # codes [B, Hg, nc, (n/G)*w], scales [B, Hg, nc, n/G]
        nc, w = c1 - c0, gq.words_per_group(b, G)
        codes.append(q.codes.reshape(B, Hg, nc, n // G, w).transpose(0, 1, 3, 2, 4).reshape(B, Hg, n // G, nc * w))
        scales.append(q.scales.swapaxes(-1, -2))
        biases.append(q.biases.swapaxes(-1, -2))
    return (_cat(codes), _cat(scales), _cat(biases), raw) if codes else (None, None, None, raw)


def decode_latents_t(codes, scales, biases, raw, n: int, layout: LatentLayout, dtype=mx.float32) -> mx.array:
    """Latentsᵀ ``[B, Hg, r, n]`` of the first ``n`` tokens (n a multiple of G) in ``dtype``."""
    G, nf = layout.group, layout.n_float
    g = n // G
    parts = [raw[:, :, :n].astype(dtype).swapaxes(-1, -2)] if nf else []
    for b, c0, c1, w0, w1 in layout.segments():
        B, Hg = codes.shape[:2]
        nc, w = c1 - c0, gq.words_per_group(b, G)
        cw = codes[:, :, :g, w0:w1].reshape(B, Hg, g, nc, w).transpose(0, 1, 3, 2, 4).reshape(B, Hg, nc, g * w)
        parts.append(gq.dequantize(cw, scales[:, :, :g, c0 - nf : c1 - nf].swapaxes(-1, -2),
                                   biases[:, :, :g, c0 - nf : c1 - nf].swapaxes(-1, -2), b, G, dtype))
    return _cat(parts, axis=2)


def measure_distortion(z: mx.array, choices, group: int) -> mx.array:
    """``[C, K]`` float32: squared error of each latent channel of ``z [B, Hg, n, C]`` at each width of
    ``choices`` (0 = dropped: the channel's energy), summed over (B, Hg, tokens)."""
    zt = z.astype(mx.float32).swapaxes(-1, -2)  # [B, Hg, C, n]
    errs = [zt * zt if b == 0 else (gq.dequantize(*gq.quantize(zt, int(b), group), int(b), group) - zt) ** 2
            for b in choices]
    return mx.stack([e.sum(axis=(0, 1, 3)) for e in errs], axis=-1)
