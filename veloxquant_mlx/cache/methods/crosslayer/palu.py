"""Palu (Chang, Lin, Lin, Chen, Huang, Hsu, Wu, Wu, Wang, Chen, Chiang, "Palu: Compressing KV-Cache with Low-Rank
Projection", arXiv 2407.21118): the K/V projection weights are factored offline, ``W ≈ A B``; the cache stores the
(quantized) latent ``h = x A`` and rebuilds ``K = h B`` (G-LRD: a group of heads factored together).

Here ``bind_attention`` (from ``KVCacheBuilder.for_model``) splits the dequantized ``k_proj`` / ``v_proj`` rows
into Hg groups (the largest divisor of H <= ``palu_n_head_groups``); a float64 SVD ``W_g = U S Vᵀ`` per group gives
``h = k U_r`` (mlx_lm hands the cache ``k``, not ``x``), r = ``palu_rank`` or the smallest holding
``palu_energy_threshold`` of ``Σσ²`` in every group; ``U_r`` (float16) is made at the first compression
(``DeferredStart``; a saved short chat needs ``bind_attention`` again, else the first ``update_and_fetch`` raises a
``ValueError`` naming the fix). Completed token groups are un-rotated with the layer's RoPE before projecting,
rebuilt keys rotated at attention; a ``k_proj`` bias (Qwen2) is the latent's offset; a per-head ``k_norm`` /
``v_norm`` (Gemma 3) is folded in as its gain (exact for one-head groups, approximate for larger). Latents are
quantized per channel over ``palu_group_size`` tokens, the first ``ceil(palu_hi_fraction · r)`` at
``palu_hi_bit``, the rest at ``palu_lo_bit`` (``palu_quantize_values=False``: value latents float16); ``attend``
fuses values on the output side, ``(p h_v) U_vᵀ + (Σp) b_v``.

Deviations: plain SVD of the weights (Palu also whitens with calibration activations and searches ranks per layer
by Fisher information); per-channel min/max over token groups, the hi/lo split by singular value (Palu: per-token
after a Walsh-Hadamard rotation); keys rebuilt before RoPE (RoPE's per-position turn does not allow SVDq's
``(q W)·z``): a CPU decode step rebuilds them per 64-row block in ``native/latent_cpu.cpp`` (``k_rebuild``: W_h z +
b, turned as waterfill's keys), the GPU attends over the rows ``update_and_fetch`` returned;
``U_r`` is stored float16 and counted in ``nbytes`` (the model keeps its own ``W_k``/``W_v``).
"""

from __future__ import annotations

import math
import mlx.core as mx
import numpy as np

from ...base import register
from ...contract import register_with_mlx_lm
from ...kernels.waterfill import rope_tables
from ...lowrank import BASIS_DTYPE, LowRankKVCache
from ...primitives import lowrank_fit as lr
from ...primitives.rope import apply_rope, rope_frequencies, rope_spec, rotate_rows
from ..deferred_start import DeferredStart

NEEDS_BINDING = ("palu factors the layer's k_proj/v_proj weights: build its caches with KVCacheBuilder.for_model("
                 "model, config) (or call cache.bind_attention(layer.self_attn)) ")


def dense_weight(linear) -> tuple[np.ndarray, np.ndarray | None]:
    """(weight [out, in], bias [out] or None) of an ``nn.Linear`` / ``nn.QuantizedLinear``, float64."""
    w = linear.weight
    if "scales" in linear:  # quantized: dequantize with the layer's own layout
        kw = {"mode": linear.mode} if getattr(linear, "mode", "affine") != "affine" else {}
        w = mx.dequantize(w, linear.scales, linear.get("biases"), group_size=linear.group_size,
                          bits=linear.bits, **kw)
    b = linear.get("bias")
    return (np.asarray(w.astype(mx.float32), dtype=np.float64),
            None if b is None else np.asarray(b.astype(mx.float32), dtype=np.float64))


def norm_gain(norm, dim: int) -> np.ndarray:
    """Per-channel gain of a per-head RMS/layer norm, read from its response to the unit rows."""
    out = np.asarray(norm(mx.eye(dim, dtype=mx.float32)).astype(mx.float32), dtype=np.float64)
    gain = np.diag(out).copy()
    if np.abs(out - np.diag(gain)).max() > 1e-5 * max(np.abs(gain).max(), 1e-30):
        raise ValueError(f"palu: the key/value norm {type(norm).__name__} mixes channels; cannot fold it")
    return gain


def factor_groups(weight: np.ndarray, n_heads: int, n_groups: int, gain=None):
    """Per head group: ``(U [Hg, F, m], σ² [Hg, m])`` of the group's rows of ``weight`` [H·D, hidden]
    (float64 SVD, m = min(F, hidden)); ``gain`` [D] scales each head's rows first (a folded norm)."""
    HD, hidden = weight.shape
    w = weight.reshape(n_heads, HD // n_heads, hidden) * (1.0 if gain is None else gain[None, :, None])
    U, S, _ = np.linalg.svd(w.reshape(n_groups, HD // n_groups, hidden), full_matrices=False)
    return U, S**2


class _Shared:
    """A reference that deep copies share (a copied cache factors the same module)."""

    def __init__(self, obj):
        self.obj = obj

    def __deepcopy__(self, memo):
        return self


@register_with_mlx_lm
@register("palu")
class PALUKVCache(DeferredStart, LowRankKVCache):
    """Palu: latents of the group-head SVD of the K/V projection weights, mixed-bit, RoPE-aware."""
    chunk_invariant, exact_trim = True, False  # factors from the weights; raises past a group
    scalar_fields = LowRankKVCache.scalar_fields + ("rope",)
    object_scalar_fields = ("rope",)  # the layer's RoPE spec (primitives.rope)
    rope = None  # the layer's RoPE (``rope_spec``), None when its keys are not rotated
    center = True  # the projection bias is the latent's offset (``k_mean``)
    latent_values = True
    calib_field = ""  # the factors are the weights': a trim never refits them
    _attn = None  # the bound attention module until its weights are factored (``_Shared``: never deep-copied)

    def _init_layout(self):
        self.group, self.qbits = self.config.options.group_size, self.config.options.hi_bit

    def _n_groups(self, n_heads: int) -> int:
        want = min(self.config.options.n_head_groups, n_heads)
        return max(d for d in range(1, want + 1) if n_heads % d == 0)

    def _bits(self, which: str, r: int) -> list:
        o = self.config.options
        if which == "v" and not o.quantize_values:
            return [lr.FLOAT_BITS] * r
        n_hi = min(r, math.ceil(r * o.hi_fraction))
        return [o.hi_bit] * n_hi + [o.lo_bit] * (r - n_hi)

    def bind_attention(self, attn) -> None:
        """Read the layer's RoPE and the factors' ranks and widths (the factors come at the first compression)."""
        if attn is None or "k_proj" not in attn or "v_proj" not in attn:
            raise ValueError(f"palu needs the layer's attention module with k_proj and v_proj; got "
                             f"{type(attn).__name__}")
        rope = getattr(attn, "rope", None)
        self.rope = rope_spec(rope) if rope is not None else None
        if rope is not None and self.rope is None:
            raise ValueError(f"palu: the layer's RoPE ({type(rope).__name__}) is not one primitives.rope can "
                             "invert, so its keys cannot be un-rotated onto the factored weights")
        self._attn = _Shared(attn)
        for name in self.refit_fields:  # drop anything encoded against other factors (the bits: set below)
            setattr(self, name, None)
        self.n_quant = 0
        self.factor(keep=False)

    def factor(self, keep: bool = True) -> None:
        """Factor ``k_proj`` / ``v_proj``: ranks, widths, head groups and, with ``keep``, the held ``U_r``, offsets."""
        o, attn = self.config.options, (self._attn.obj if self._attn is not None else None)
        if attn is None:
            raise ValueError(NEEDS_BINDING + "before its first compressed group")
        wk, bk = dense_weight(attn.k_proj)
        wv, bv = dense_weight(attn.v_proj)
        n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
        n_kv = int(n_kv) if n_kv else wk.shape[0] // int(self.config.head_dim)
        D = wk.shape[0] // n_kv
        self.hg = self._n_groups(n_kv)
        for which, w, b, norm in (("k", wk, bk, attn.get("k_norm")), ("v", wv, bv, attn.get("v_norm"))):
            gain = None
            if norm is not None:
                if b is not None:
                    raise ValueError(f"palu: a {which}_proj bias under a {which}_norm cannot be factored")
                gain = norm_gain(norm, D)
            U, energy = factor_groups(w, n_kv, self.hg, gain)  # energy: σ² [Hg, m], decreasing
            r = (min(o.rank, energy.shape[-1]) if o.rank is not None
                 else lr.energy_rank(mx.array(energy.astype(np.float32)), o.energy_threshold))
            setattr(self, f"{which}_bits", self._bits(which, r))
            if keep:
                setattr(self, f"{which}_basis", mx.array(U[None, :, :, :r].astype(np.float32)).astype(BASIS_DTYPE))
                setattr(self, f"{which}_mean", None if b is None else
                        mx.array(b.reshape(1, self.hg, 1, -1).astype(np.float32)).astype(BASIS_DTYPE))
        if keep:
            self._attn = None  # the factors are held now: the model's module is not needed any more

    def _compressed_cost(self, H, D, Dv):
        """Factors (and offsets) of both sides, and their latent codes per token (``DeferredStart``)."""
        fixed = sum(H * d * (len(getattr(self, f"{w}_bits")) + 1) * 2 for w, d in (("k", D), ("v", Dv)))
        return fixed, self.hg * (self.layout("k").bytes_per_token() + self.layout("v").bytes_per_token())

    def _store(self, keys, values):
        if self.k_bits is None:
            raise ValueError(NEEDS_BINDING + "before the first update_and_fetch")
        super()._store(keys, values)

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        if self.k_basis is None:
            self.factor()
        t0, n, k = self.n_quant, kb.shape[2], kb.astype(mx.float32)
        if self.rope is not None:  # pre-RoPE keys at positions t0.. (each angle from its position alone)
            k = apply_rope(k, self.rope, t0, inverse=True)
        self._encode("k", lr.group_heads(k, self.hg), t0)
        self._encode("v", lr.group_heads(vb.astype(mx.float32), self.hg), t0)
        self.n_quant = t0 + n

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        """Kᵀ [B, H, D, n]: keys rebuilt from the latents (``h U_rᵀ + b``), rotated to positions 0..n-1."""
        k = self._reconstruct("k", n)
        if self.rope is not None:
            k = rotate_rows(k, self.rope, rope_frequencies(self.rope), 0)
        return k.swapaxes(-1, -2).astype(dtype)

    def _key_scores(self, q: mx.array, n: int) -> mx.array:
        return q @ self._keys_t(n)

    def _cpu_layout(self) -> bool:
        """The CPU kernel reads Palu's latents once fitted, rebuilding its pre-RoPE keys per block (``_cpu_keys``)."""
        return self.k_bits is not None and self.k_basis is not None

    def _cpu_keys(self, qf):
        """``latent_decode``'s keys for scaled queries ``qf`` [B, H, M, D]: the model's queries by head group, each
        block's keys rebuilt per head (``U_r`` and the offset), turned by the layer's RoPE, scored exactly."""
        B, H, M, D = qf.shape
        rope = dict(rope=list(rope_tables(self.rope, D)), rotate=self.rope is not None)
        return qf.reshape(B, self.hg, (H // self.hg) * M, D), None, dict(k_rebuild=self.k_basis,
                                                                          k_rebuild_mean=self.k_mean, **rope)
