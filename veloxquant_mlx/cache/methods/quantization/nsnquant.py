"""NSNQuant (Son, Choi, Kim, et al., arXiv 2505.18231): Normalize-Shift-Normalize (per-token L2 normalization,
minus the channel mean, normalization again) and a Hadamard rotation make every token look like a random point on
the sphere, so one data-independent codebook serves every model and layer without calibration data.

On KIVI's float16 window of ``nsn_residual_length`` tokens, keys and values alike: ``y = sqrt(D) w H^T`` (``w``
the NSN of ``x``; channel mean ``mu`` from the first coded block and both norms float16; ``H`` a seeded
randomized Hadamard), cut into ``nsn_subvector_dim``-dim sub-vectors coded by residual VQ stages of
``nsn_codebook_size`` codewords (``nsn_bits`` bits per coordinate) from seeded k-means on sqrt(D)-scaled random
unit vectors (the NSN output law).

Deviations from the paper: the channel mean comes from the cache's own first coded block, reused by later tokens;
the codebook is trained on synthetic sphere samples (the paper: NSN outputs of one model's real data), the 2-bit
rate by residual VQ stages of the same codebook size; no codebook fine-tuning; KIVI's full-precision window;
keys coded after RoPE; trim exact for window tokens + whole groups, and a trim into the block the mean came from
(other than all of it) raises ``ValueError``. Attention dequantizes the codes, except a CPU decode step with one or
two stages: TurboQuant-RVQ's CPU kernel (``native/turboquant_rvq_cpu.cpp``) reads each row's codes once, scoring
keys by lookup tables of the rotated query (``q . k = n1 n2 (H q / sqrt(D)) . y + n1 (q . mu)``) and summing values'
weights per (sub-vector, codeword), turned back once (``_cpu_part``).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives import bitpack
from ...primitives.buffers import grow_rows
from ...primitives.codebook import kmeans
from ...primitives.rotation import randomized_hadamard, seeded_rng
from ...primitives.vq import vq_assign
from ...window import Partials
from .kivi import RES_DTYPE, KIVIKVCache, SideRows

_TAG_NSN = 0x0A7E_0B01
_N_SAMPLES = 16384


@functools.lru_cache(maxsize=16)
def nsn_codebooks(D: int, d: int, C: int, S: int, seed: int) -> mx.array:
    """[S, C, d] residual-VQ codebooks for sub-vectors of sqrt(D)-scaled random unit vectors in R^D."""
    g = seeded_rng(_TAG_NSN, seed).standard_normal((_N_SAMPLES * d // D + 1, D))
    g = g / np.linalg.norm(g, axis=1, keepdims=True) * math.sqrt(D)
    r = mx.array(g.reshape(-1, d)[:_N_SAMPLES].astype(np.float32))
    books = []
    for s in range(S):  # S residual stages (2 by default)
        cent, lab = kmeans(r, C, iters=20, seed=seed + s)
        books.append(cent)
        r = r - cent[lab.astype(mx.int32)]
    out = mx.stack(books)
    mx.eval(out)
    return out


@functools.lru_cache(maxsize=8)
def unit_sigma(C: int) -> mx.array:
    """[C] ones: the RVQ kernel's stage-2 scale per stage-1 cell, which NSNQuant's stages do not have."""
    out = mx.ones((C,), mx.float32)
    mx.eval(out)
    return out


def vq_encode(y: mx.array, books: mx.array) -> mx.array:
    """y [..., D] -> codes [..., S * D/d] (stage-major) with residual VQ on d-dim sub-vectors."""
    S, C, d = books.shape
    lead, D = y.shape[:-1], y.shape[-1]
    r, codes = y.reshape(-1, d), []
    for cb in books:  # S stages (2 by default), not a loop over tokens
        c = vq_assign(r[None], cb[None])[0]
        codes.append(c.reshape(*lead, D // d))
        r = r - cb[c]
    return mx.concatenate(codes, axis=-1)


def vq_decode(codes: mx.array, books: mx.array, D: int) -> mx.array:
    S, C, d = books.shape
    lead = codes.shape[:-1]
    c = codes.reshape(*lead, S, D // d).astype(mx.int32)
    y = mx.take(books.reshape(S * C, d), c + (mx.arange(S) * C)[:, None], axis=0)  # [..., S, D/d, d]
    return y.sum(-3).reshape(*lead, D)


def nsn_forward(x: mx.array, mu: mx.array | None, rot: mx.array):
    """NSN + rotation: x [B, H, n, D] -> (y [B, H, n, D] ~ N(0,1) coords, n1, n2 [B, H, n], mu [B, H, D]).
    mu None: computed from x (the mean of the normalized tokens) and returned."""
    D = x.shape[-1]
    x = x.astype(mx.float32)
    n1 = mx.sqrt((x * x).sum(-1))
    u = x / mx.maximum(n1, 1e-12)[..., None]
    if mu is None:
        mu = u.mean(axis=2).astype(mx.float16)
    s = u - mu.astype(mx.float32)[:, :, None]
    n2 = mx.sqrt((s * s).sum(-1))
    w = s / mx.maximum(n2, 1e-12)[..., None]
    return math.sqrt(D) * (w @ rot.T), n1, n2, mu


def nsn_inverse(y, n1, n2, mu, rot):
    D = y.shape[-1]
    w = (y / math.sqrt(D)) @ rot
    return n1[..., None] * (n2[..., None] * w + mu.astype(mx.float32)[:, :, None])


@register_with_mlx_lm
@register("nsnquant")
class NSNQuantKVCache(SideRows, KIVIKVCache):
    """NSN-normalized, Hadamard-rotated tokens, residual VQ of d-dim sub-vectors with a fixed codebook."""
    chunk_invariant = False  # channel mean taken from the first coded block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group
    array_fields = ("k_codes", "k_norms", "k_mu", "v_codes", "v_norms", "v_mu", "res_k", "res_v")
    scalar_fields = KIVIKVCache.scalar_fields + ("calib_end",)
    calib_end = 0  # encoded tokens the channel means were taken from (0: none taken)
    calib_field, refit_fields = "calib_end", ("k_mu", "v_mu")
    dequant_only = "vector-quantized codes"

    def _init_layout(self):
        o = self.config.options
        self.group, self.qbits, self.seed = o.residual_length, o.bits, o.seed
        self.C, self.lc, self.sub = o.codebook_size, int(math.log2(o.codebook_size)), o.subvector_dim
        self.stages = self.qbits * self.sub // self.lc

    def _tools(self, D: int):
        if D & (D - 1) or D % self.sub:
            raise QuantizerConfigError("head_dim", D, f"a power of two divisible by nsn_subvector_dim={self.sub}")
        return randomized_hadamard(D, self.seed), nsn_codebooks(D, self.sub, self.C, self.stages, self.seed)

    def _append_groups(self, kb, vb):
        t0, n = self.n_quant, kb.shape[2]
        for p, x in (("k", kb), ("v", vb)):
            rot, books = self._tools(x.shape[-1])
            y, n1, n2, mu = nsn_forward(x.astype(RES_DTYPE), getattr(self, f"{p}_mu"), rot)
            setattr(self, f"{p}_mu", mu)
            codes = bitpack.pack_bits(vq_encode(y, books), self.lc)
            norms = mx.stack([n1, n2], axis=-1).astype(mx.float16)
            setattr(self, f"{p}_codes", grow_rows(getattr(self, f"{p}_codes"), t0, codes))
            setattr(self, f"{p}_norms", grow_rows(getattr(self, f"{p}_norms"), t0, norms))
        if t0 == 0:
            self.calib_end = n
        self.n_quant = t0 + n

    def _decode(self, p: str, n: int, dtype) -> mx.array:
        mu = getattr(self, f"{p}_mu")
        D = mu.shape[-1]
        rot, books = self._tools(D)
        codes = bitpack.unpack_bits(getattr(self, f"{p}_codes")[:, :, :n], self.lc, self.stages * D // self.sub)
        norms = getattr(self, f"{p}_norms")[:, :, :n].astype(mx.float32)
        return nsn_inverse(vq_decode(codes, books, D), norms[..., 0], norms[..., 1], mu, rot).astype(dtype)

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        return self.qbits * (d + dv) / 8 + 8

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        return sum(B * H * (self.n_quant * (bitpack.packed_nbytes(self.stages * d // self.sub, self.lc) + 4)
                            + (0 if self.k_mu is None else d * 2)) for d in (D, dv))

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: TurboQuant-RVQ's CPU kernel over the packed codes

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes the RVQ CPU kernel reads: one or two stages, each stage's codes of a row whole words (stage 2 found
        at a word offset), head dims up to 256, up to 32 query heads a KV head."""
        whole = all((x // self.sub * self.lc) % 32 == 0 for x in (d, dv))
        return (native.available() and self.attend_path == "auto" and self.stages <= 2 and whole
                and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` coded tokens' partials for scaled float32 queries ``qf`` [B, H, R, D]: the kernel scores
        ``n1 n2 (q H^T / sqrt(D)) . y + n1 (q . mu_k)`` and returns the values' weighted codeword sum ``sum p n1 n2 y``
        (turned back here: ``@ H / sqrt(dv)``) and the mean's weight ``sum p n1`` as acc's last column."""
        d, dv = qf.shape[-1], self.res_v.shape[-1]
        (rot_k, books_k), (rot_v, books_v) = self._tools(d), self._tools(dv)
        ones = unit_sigma(self.C)

        def side(p, books, dim):
            two = self.stages == 2
            word2 = dim // self.sub * self.lc // 32 if two else 0
            codes = getattr(self, f"{p}_codes")
            return (codes, codes if two else None, getattr(self, f"{p}_norms"), books[0], ones,
                    books[1] if two else None), word2

        (ks, kw2), (vs, vw2) = side("k", books_k, d), side("v", books_v, dv)
        bias = (qf * self.k_mu.astype(mx.float32)[:, :, None]).sum(-1)
        m, l, acc = native.module().turboquant_rvq_decode(  # noqa: E741
            (qf @ rot_k.T) * (1 / math.sqrt(d)), *ks, *vs, n, dv, counts=list(counts), k_bias=bias, k_word2=kw2,
            v_word2=vw2)
        out = acc[..., :dv] @ rot_v * (1 / math.sqrt(dv)) + acc[..., dv:] * self.v_mu.astype(mx.float32)[:, :, None]
        return Partials(m, l, out)

