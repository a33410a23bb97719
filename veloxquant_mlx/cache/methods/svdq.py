"""SVDq (Hong, Li, Zhen, Yu, Liu, Yuan, "SVDq: 1.25-bit and 410x Key Cache Compression for LLM
Attention", arXiv 2502.15304), and ``LowRankKVCache``, the latent-storage base shared with ``palu`` and
``kvtc``.

SVDq, as in the paper: the key matrix ``K`` [T, D] of a head is written in its SVD basis,
``K = (K V) Vᵀ``; the columns of ``K V`` are the *latent channels*, whose magnitudes decay with the
singular values. Latent channels are quantized per channel with a **decreasing bit schedule**: the
most significant channels get the most bits, the tail is dropped (0 bits). Attention uses
``q·Kᵀ = (q V)·(K V)ᵀ``.

This implementation (``svdq_rank`` r or ``svdq_energy_threshold`` e, ``svdq_bit_schedule``
(b_0 >= b_1 >= ... ), ``svdq_group_size`` G):

* **Fit once, at prefill, on the first block**: the first time whole groups of G tokens are stored
  (prefill: every complete group of the first chunk), the right singular vectors ``V`` [D, D] of that
  block's keys are computed per (batch, head) (eigendecomposition of ``KᵀK``, ``lowrank_fit``). The
  rank is ``svdq_rank`` or, when None, the smallest r whose leading components hold at least e of the
  block's key energy (``Σ σ_i²``) in every head. The basis is never refitted per decode step; later
  groups are projected onto it.
* **Bit schedule**: with S schedule entries and D latent channels, channel c gets ``b[c*S // D]``
  (the schedule is spread over the head dimension in S equal segments, as in the paper's
  per-segment allocation); channels >= r get 0 (dropped). Latent channel c of a group of G tokens is
  quantized with one float16 scale and bias (``groupquant``, bit widths 1..8, packed in uint32 words).
* **Values** are not part of SVDq (a key-cache method): they are quantized as KIVI does (per token,
  ``bit_width_inlier`` bits in {2, 3, 4, 8}, channel groups of gcd(D, G)).
* Residual: the newest < G tokens stay float16 (KIVI's residual; this class subclasses
  ``KIVIKVCache``), and a call's own rows are attended in full precision.
* ``attend`` (dispatch point) works on the latent codes: ``s = (q·V_r)·Zᵀ`` with ``Z`` the dequantized
  latents, one softmax over [latent part, full-precision part]; ``update_and_fetch`` returns the
  reconstructed keys ``Z V_rᵀ`` (same numbers up to float32 rounding).
* Bytes per token per head: ``Σ_c (b_c/8 + 4/G)`` over kept channels for keys, KIVI's for values,
  plus the basis ``D·r`` float16 per head per prompt.

Deviations: the basis is fitted on the prompt's first block of the cache itself (the paper fits an
SVD of the prefill key cache too, but per sequence over the whole prefill; here later prefill chunks
reuse the first chunk's basis), from the post-RoPE keys mlx_lm hands the cache; the schedule is spread
in segments over D (the paper gives explicit per-channel-block widths); per-channel token groups of
G (KIVI-style min/max) are the quantizer; no sparsity (the paper's ShadowKV combination); values by
KIVI; residual/trim/prefill semantics as in ``KIVIKVCache`` (exact trims only; a trim that empties
the quantized part resets the basis so the next block refits it).
"""

from __future__ import annotations

import mlx.core as mx

from ..attention import bool_mask, group_queries, ungroup
from ..base import register
from ..contract import register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.buffers import grow_rows, reserve_rows
from ..primitives import groupquant as gq
from ..primitives import lowrank_fit as lr
from .kivi import KIVIKVCache


BASIS_DTYPE = mx.float16  # fitted bases and means as stored


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_rank_energy(prefix: str, rank, energy) -> None:
    if rank is not None and (not _is_int(rank) or rank < 1):
        raise QuantizerConfigError(f"{prefix}_rank", rank, "None or a positive int")
    if isinstance(energy, bool) or not isinstance(energy, (int, float)) or not 0.0 < energy <= 1.0:
        raise QuantizerConfigError(f"{prefix}_energy_threshold", energy, "a float in (0, 1]")


def check_group(field: str, g) -> None:
    if not _is_int(g) or g < 1:
        raise QuantizerConfigError(field, g, "a positive int (tokens per quantization group)")


class LowRankKVCache(KIVIKVCache):
    """Latent (low-rank) storage on KIVI's residual window (not registered: the base of svdq, palu,
    kvtc).

    Keys (and, with ``latent_values``, values) of whole token groups are stored as latents
    ``Z = (X - μ) P`` of a per-(batch, head group) basis ``P`` [F, r] fitted on the first block
    (F = heads per group × D), quantized per latent channel with per-channel bit widths
    (``lowrank_fit.LatentLayout``). Subclasses choose the head grouping, centering and the bits
    (``_n_groups``, ``center``, ``_choose_bits``).

    The fit (one eigendecomposition per (batch, group), the rank / bit choice: one host sync) runs
    once per prompt, when the first whole group of G tokens is stored: during prefill, or, for a
    prompt shorter than G, at the one decode step that completes the first group. Every other
    prefill chunk and decode step only projects and quantizes (no host sync, no Python loop over
    tokens, heads or batch: only over the <= 9 distinct bit widths). Arrays: ``{k,v}_basis``
    [B, Hg, F, r] float16, ``{k,v}_mean`` [B, Hg, 1, F] float16 (centered subclasses), ``{k,v}_codes``
    [B, Hg, groups, words] uint32, ``{k,v}_scales``/``_biases`` [B, Hg, groups, r_q] float16,
    ``{k,v}_raw`` [B, Hg, tokens, r_f] float16 (channels kept unquantized), plus KIVI's residual."""

    array_fields = ("k_basis", "k_mean", "k_codes", "k_scales", "k_biases", "k_raw",
                    "v_basis", "v_mean", "v_codes", "v_scales", "v_biases", "v_raw", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "k_bits", "v_bits", "hg")

    latent_values = True  # values stored as latents too (else KIVI per-token codes)
    center = False  # subtract the block mean before projecting (PCA) or not (SVD)
    attend_path = "dequant"
    k_bits = None  # per kept latent channel (non-increasing), set at fit
    v_bits = None
    hg = 0  # head groups, set at fit

    # ------------------------------------------------------------------ subclass hooks
    def _n_groups(self, n_heads: int) -> int:
        return n_heads

    def _choose_bits(self, which: str, z: mx.array, energy: mx.array) -> list:
        """Bits per latent component (F of them, by decreasing energy; 0 = dropped) from the fit
        block's latents ``z [B, Hg, n, F]`` and component energies ``[B, Hg, F]``."""
        raise NotImplementedError

    def _uses_qmm(self) -> bool:
        return False

    # ------------------------------------------------------------------ fit + encode
    def _fit(self, which: str, x: mx.array) -> None:
        """Fit the basis of ``which`` ('k'/'v') on grouped rows ``x [B, Hg, n, F]``."""
        basis, energy, mean = lr.fit_basis(x, center=self.center)
        z = (x - mean if mean is not None else x) @ basis
        bits = [int(b) for b in self._choose_bits(which, z, energy)]
        order = sorted(range(len(bits)), key=lambda c: -bits[c])  # stable: energy order within a width
        kept = [c for c in order if bits[c] > 0]
        if not kept:
            raise ValueError(f"{type(self).__name__}: the bit allocation keeps no latent channel")
        basis = basis[..., mx.array(kept)] if kept != list(range(len(kept))) else basis[..., : len(kept)]
        # stored float16 (half the per-prompt fixed cost; every use reads the stored, rounded basis, so
        # encoding, reconstruction and the fused attention agree exactly)
        setattr(self, f"{which}_basis", basis.astype(BASIS_DTYPE))
        setattr(self, f"{which}_mean", None if mean is None else mean.astype(BASIS_DTYPE))
        setattr(self, f"{which}_bits", [bits[c] for c in kept])

    def layout(self, which: str) -> lr.LatentLayout:
        return lr.LatentLayout(tuple(getattr(self, f"{which}_bits")), self.group)

    def _basis(self, which: str):
        """The stored basis and mean of ``which`` in float32."""
        basis, mean = getattr(self, f"{which}_basis"), getattr(self, f"{which}_mean")
        return basis.astype(mx.float32), None if mean is None else mean.astype(mx.float32)

    def _encode(self, which: str, x: mx.array, t0: int) -> None:
        basis, mean = self._basis(which)
        z = (x - mean if mean is not None else x) @ basis
        codes, scales, biases, raw = lr.encode_latents(z, self.layout(which))
        g0 = t0 // self.group
        for name, arr, row in (("codes", codes, g0), ("scales", scales, g0), ("biases", biases, g0),
                               ("raw", raw, t0)):
            if arr is not None:
                f = f"{which}_{name}"
                buf = getattr(self, f) if name == "raw" else reserve_rows(getattr(self, f), row, arr, 1)
                setattr(self, f, grow_rows(buf, row, arr))  # per-group rows: 1/32 spare, not 16 groups

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        t0, n = self.n_quant, kb.shape[2]
        H = kb.shape[1]
        if self.k_basis is None:
            self.hg = self._n_groups(H)
        xk = lr.group_heads(kb.astype(mx.float32), self.hg)
        if self.k_basis is None:
            self._fit("k", xk)
        self._encode("k", xk, t0)
        if self.latent_values:
            xv = lr.group_heads(vb.astype(mx.float32), self.hg)
            if self.v_basis is None:
                self._fit("v", xv)
            self._encode("v", xv, t0)
        else:  # KIVI per-token value codes
            vq = gq.quantize(vb, self.qbits, self.value_group(vb.shape[-1]))
            self.v_codes = grow_rows(self.v_codes, t0, vq.codes)
            self.v_scales = grow_rows(self.v_scales, t0, vq.scales)
            self.v_biases = grow_rows(self.v_biases, t0, vq.biases)
        self.n_quant = t0 + n

    # ------------------------------------------------------------------ decoding
    def _latents_t(self, which: str, n: int, dtype=mx.float32) -> mx.array:
        return lr.decode_latents_t(getattr(self, f"{which}_codes"), getattr(self, f"{which}_scales"),
                                   getattr(self, f"{which}_biases"), getattr(self, f"{which}_raw"), n,
                                   self.layout(which), dtype)

    def _head_proj(self, which: str):
        """Per-head reconstruction: W [B, H, D, r] (rows of the group basis belonging to each head) and
        the mean [B, H, 1, D] (or None)."""
        basis, mean = self._basis(which)
        B, Hg, F, r = basis.shape
        H = self.res_k.shape[1]
        s = H // Hg
        W = basis.reshape(B, Hg, s, F // s, r).reshape(B, H, F // s, r)
        mu = None if mean is None else mean.reshape(B, H, 1, F // s)
        return W, mu

    def _reconstruct(self, which: str, n: int) -> mx.array:
        """[B, H, n, D] rows rebuilt from the latents."""
        zt = self._latents_t(which, n)  # [B, Hg, r, n]
        basis, mean = self._basis(which)
        x = zt.swapaxes(-1, -2) @ basis.swapaxes(-1, -2)
        if mean is not None:
            x = x + mean
        return lr.ungroup_heads(x, self.res_k.shape[1])

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return self._reconstruct("k", n).swapaxes(-1, -2).astype(dtype)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        if self.latent_values:
            return self._reconstruct("v", n).astype(dtype)
        return super()._values(n, dtype)

    # ------------------------------------------------------------------ fused attention hooks
    def _key_scores(self, q: mx.array, n: int) -> mx.array:
        """``q [B, H, M, D] · Kᵀ`` over the first n latent tokens without rebuilding keys:
        ``(q W_h)·Zᵀ (+ q·μ_h)``."""
        B, H, M, _ = q.shape
        W, mu = self._head_proj("k")
        zt = self._latents_t("k", n)  # [B, Hg, r, n]
        Hg = zt.shape[1]
        s = ((q @ W).reshape(B, Hg, (H // Hg) * M, -1) @ zt).reshape(B, H, M, n)
        if mu is not None:
            s = s + q @ mu.swapaxes(-1, -2)
        return s

    def _value_out(self, p: mx.array, n: int) -> mx.array:
        """``p [B, H, M, n] · V`` over the first n tokens: ``(p Z_v) W_vᵀ (+ Σp μ_v)`` for latents."""
        if not self.latent_values:
            return p @ self._values(n)
        B, H, M, _ = p.shape
        W, mu = self._head_proj("v")
        zt = self._latents_t("v", n)  # [B, Hg, r, n]
        Hg = zt.shape[1]
        pz = (p.reshape(B, Hg, (H // Hg) * M, n) @ zt.swapaxes(-1, -2)).reshape(B, H, M, -1)
        out = pz @ W.swapaxes(-1, -2)
        if mu is not None:
            out = out + p.sum(axis=-1, keepdims=True) * mu
        return out

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """Scores over [latent part, full-precision part], one softmax (KIVI's attend with the
        latent-side products ``_key_scores`` / ``_value_out``)."""
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is None or call[4].shape[2] != N or keys.shape[2] != call[0] + call[1] + N:
            return super(KIVIKVCache, self).attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        q0, r0, past_k, past_v, new_k, new_v = call
        mask = self._own_mask(mask, queries, keys)
        if q0 + r0 == 0:
            return mx.fast.scaled_dot_product_attention(queries, new_k, new_v, scale=scale, mask=mask,
                                                        sinks=sinks)
        B, Hq, _, D = queries.shape
        H = new_k.shape[1]
        rep, M = Hq // H, q0 + r0 + N
        q = (group_queries(queries, H).astype(mx.float32) * scale).reshape(B, H, rep * N, D)
        fk, fv = new_k, new_v
        if r0:
            fk = mx.concatenate([past_k.astype(new_k.dtype), new_k], axis=2)
            fv = mx.concatenate([past_v.astype(new_v.dtype), new_v], axis=2)
        parts = [q @ fk.astype(mx.float32).swapaxes(-1, -2)]
        if q0:
            parts.insert(0, self._key_scores(q, q0))
        if sinks is not None:
            sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, rep, 1, 1), (B, H, rep, N, 1))
            parts.insert(0, sink.reshape(B, H, rep * N, 1))
        s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        lead = s.shape[-1] - M
        s = s.reshape(B, H, rep, N, s.shape[-1])
        if isinstance(mask, str):
            if N > 1:
                cols = mx.arange(r0 + N)[None] - r0
                visible = cols <= mx.arange(N)[:, None]
                s = mx.concatenate([s[..., : lead + q0], mx.where(visible, s[..., lead + q0 :], -mx.inf)], axis=-1)
        elif mask is not None:
            m = bool_mask(mask, N, M, H)
            if lead:
                m = mx.concatenate([mx.ones((*m.shape[:-1], 1), dtype=mx.bool_), m], axis=-1)
            s = mx.where(m, s, -mx.inf)
        p = mx.softmax(s, axis=-1, precise=True).reshape(B, H, rep * N, s.shape[-1])
        out = p[..., lead + q0 :] @ fv.astype(mx.float32)
        if q0:
            out = out + self._value_out(p[..., lead : lead + q0], q0)
        return ungroup(out.reshape(B, H, rep, N, out.shape[-1])).astype(queries.dtype)

    # ------------------------------------------------------------------ trim / accounting
    def _trim_rows(self, n: int) -> int:
        dropped = super()._trim_rows(n)
        if self.n_quant == 0:  # nothing encoded is left: the next block refits (as if never seen)
            for name in self.array_fields:
                if name not in ("res_k", "res_v"):
                    setattr(self, name, None)
            self.k_bits = self.v_bits = None
        return dropped

    def _part_bytes(self, which: str, used: bool = True) -> int:
        """Bytes of ``which``'s latent storage (basis, mean, codes, scales, biases, float16 channels);
        ``used`` counts the filled rows only."""
        total = 0
        for name in ("basis", "mean", "codes", "scales", "biases", "raw"):
            a = getattr(self, f"{which}_{name}")
            if a is None:
                continue
            if used and name in ("codes", "scales", "biases", "raw"):
                rows = self.n_quant if name == "raw" else self.n_quant // self.group
                total += a.nbytes // a.shape[2] * rows
            else:
                total += a.nbytes
        return total

    def _kivi_value_bytes(self) -> int:
        if self.res_v is None or self.latent_values:
            return 0
        B, H, _, dv = self.res_v.shape
        gv = self.value_group(dv)
        return B * H * self.n_quant * (dv // gv) * (4 * gq.words_per_group(self.qbits, gv) + 2 * 2)

    @property
    def used_nbytes(self) -> int:
        if self.res_k is None:
            return 0
        v = self._part_bytes("v") if self.latent_values else self._kivi_value_bytes()
        return self._part_bytes("k") + v + self.res_k.nbytes + self.res_v.nbytes

    @property
    def projection_bytes(self) -> int:
        """Bytes of the fitted bases and means (float16), keys and values."""
        return sum(a.nbytes for a in (self.k_basis, self.k_mean, self.v_basis, self.v_mean) if a is not None)

    @property
    def compressed_key_bytes(self) -> int:
        """Stored key bytes: latent codes/scales/biases of the filled rows + key basis/mean + the
        float16 key residual buffer."""
        return self._part_bytes("k") + (self.res_k.nbytes if self.res_k is not None else 0)

    @property
    def compressed_value_bytes(self) -> int:
        v = self._part_bytes("v") if self.latent_values else self._kivi_value_bytes()
        return v + (self.res_v.nbytes if self.res_v is not None else 0)

    @property
    def fp16_key_bytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        return B * H * self.offset * D * 2

    @property
    def fp16_value_bytes(self) -> int:
        if self.res_v is None:
            return 0
        B, H, _, D = self.res_v.shape
        return B * H * self.offset * D * 2

    @property
    def rank(self) -> int:
        """Latent key channels kept (uniform across heads / head groups); 0 before the fit."""
        return len(self.k_bits) if self.k_bits else 0

    @property
    def value_rank(self) -> int:
        return len(self.v_bits) if self.v_bits else 0

    @property
    def assigned_avg_bits(self) -> float:
        """Stored bits per original K and V element (both together, everything counted: codes,
        scales, bases, residual); 16 = no compression."""
        fp = self.fp16_key_bytes + self.fp16_value_bytes
        return 16.0 * (self.compressed_key_bytes + self.compressed_value_bytes) / fp if fp else 16.0


@register_with_mlx_lm
@register("svdq")
class SVDqKVCache(LowRankKVCache):
    """SVDq: keys as SVD latents with a decreasing per-channel bit schedule; values as KIVI."""
    chunk_invariant = False  # key basis and rank fitted on the first quantized block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_basis", "k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases",
                    "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "k_bits", "hg", "fit_rank")
    latent_values = False
    fit_rank = 0  # rank picked at the fit (svdq_rank or the energy threshold), before the schedule
    center = False
    k_mean = v_mean = k_raw = v_basis = v_raw = None

    def _init_layout(self):
        super()._init_layout()  # KIVI: bit_width_inlier (values) and the residual
        c = self.config
        check_rank_energy("svdq", c.svdq_rank, c.svdq_energy_threshold)
        sched = c.svdq_bit_schedule
        if (not isinstance(sched, (tuple, list)) or not sched or any(not _is_int(b) or not 0 <= b <= 8 for b in sched)
                or list(sched) != sorted(sched, reverse=True) or sched[0] == 0):
            raise QuantizerConfigError("svdq_bit_schedule", sched,
                                       "a non-empty, non-increasing sequence of ints in 0..8 starting above 0")
        check_group("svdq_group_size", c.svdq_group_size)
        self.group = int(c.svdq_group_size)
        self.schedule = tuple(int(b) for b in sched)

    def _choose_bits(self, which, z, energy):
        F = energy.shape[-1]
        c = self.config
        r = c.svdq_rank if c.svdq_rank is not None else lr.energy_rank(energy, c.svdq_energy_threshold)
        r = min(r, F)
        self.fit_rank = int(r)
        S = len(self.schedule)
        return [self.schedule[ch * S // F] if ch < r else 0 for ch in range(F)]
