"""``LowRankKVCache``: latent (low-rank) storage on KIVI's residual layout, the family base of the low-rank
quantizers (svdq, palu, kvtc); a decode step's attention reads the latents (``q·Kᵀ = (q W)·Zᵀ``, ``p·V = (p Z_v)
W_vᵀ``), on the CPU in one pass of ``native/latent_cpu.cpp`` (``_cpu_part``), a prefill chunk's is KIVI's online
softmax over tiles of the rows rebuilt once.
"""

from __future__ import annotations

import mlx.core as mx

from . import native
from .contract import CompressedKVCache
from .grouped import GroupedQuantCache
from .primitives import blocks
from .primitives import groupquant as gq
from .primitives import lowrank_fit as lr
from .primitives.buffers import grow_rows, reserve_rows
from .window import Partials

BASIS_DTYPE = mx.float16  # fitted bases and means as stored


class LowRankKVCache(GroupedQuantCache):
    """Latent storage on KIVI's residual window (the unregistered base of svdq, palu, kvtc).

    Keys (and, with ``latent_values``, values) of whole token groups are stored as latents ``Z = (X - μ) P``
    of a per-(batch, head group) basis ``P [F, r]`` (F = heads per group × D), each latent channel quantized
    at its own width (``lowrank_fit.LatentLayout``); subclasses choose ``_n_groups``, ``center`` and
    ``_choose_bits``. The fit (one eigendecomposition per (batch, group), one host sync) runs once per prompt,
    at the first whole group of G tokens; later rows only project and quantize. Arrays: ``{k,v}_basis``
    [B, Hg, F, r], ``_mean`` [B, Hg, 1, F] float16, ``_codes`` [B, Hg, groups, words], ``_scales``/``_biases``
    [B, Hg, groups, r_q], ``_raw`` [B, Hg, tokens, r_f] float16 (unquantized channels), KIVI's residual."""

    array_fields = ("k_basis", "k_mean", "k_codes", "k_scales", "k_biases", "k_raw",
                    "v_basis", "v_mean", "v_codes", "v_scales", "v_biases", "v_raw", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "k_bits", "v_bits", "hg", "calib_end")

    latent_values = True  # values stored as latents too (else KIVI per-token codes)
    center = False  # subtract the block mean before projecting (PCA) or not (SVD)
    attend_path = "dequant"
    k_bits = None  # per kept latent channel (non-increasing), set at fit
    v_bits = None
    hg = 0  # head groups, set at fit
    calib_end = 0  # encoded tokens the basis was fitted on (0: none fitted)
    calib_field = "calib_end"  # a trim emptying the latents resets all but the residual: the next block refits
    refit_fields = ("k_basis", "k_mean", "k_codes", "k_scales", "k_biases", "k_raw", "k_bits",
                    "v_basis", "v_mean", "v_codes", "v_scales", "v_biases", "v_raw", "v_bits")

    def _n_groups(self, n_heads: int) -> int:
        return n_heads

    def _choose_bits(self, which: str, z: mx.array, energy: mx.array) -> list:
        """Bits per latent component (by decreasing energy; 0 = dropped) from the fit block's latents
        ``z [B, Hg, n, F]`` and energies ``[B, Hg, F]``."""
        raise NotImplementedError

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
        # stored float16 (half the fixed cost); every use reads the stored basis, so all paths agree exactly
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
                f, buf = f"{which}_{name}", getattr(self, f"{which}_{name}")
                if name != "raw":  # rows are groups of G tokens: spare 1/32 + 1 group, not grow_rows' 16
                    buf = reserve_rows(buf, row, arr, 1)
                setattr(self, f, grow_rows(buf, row, arr))

    def _store(self, keys, values):
        """KIVI's ``_store``, then ``blocks.settle_prefill``: a prefill call waits for the cache's arrays, so the
        fit and encode are done before the layer's attention is queued (left to the chunk's end, every
        layer's rows and encode temporaries were alive together: SmolLM2, 1023 tokens in one chunk, kvtc 1.25x, svdq
        1.07x the plain cache's peak)."""
        super()._store(keys, values)
        blocks.settle_prefill(keys.shape[2], self.held_arrays)

    def _short_steps(self) -> bool:
        """As KIVI's: this ``_store`` adds only a prefill wait (a subclass storing its own way does not skip it)."""
        return type(self)._store is LowRankKVCache._store

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        t0, n = self.n_quant, kb.shape[2]
        if self.k_basis is None:
            self.hg = self._n_groups(kb.shape[1])
            self.calib_end = t0 + n
        for which, rows in (("k", kb), ("v", vb)) if self.latent_values else (("k", kb),):
            x = lr.group_heads(rows.astype(mx.float32), self.hg)
            if getattr(self, f"{which}_basis") is None:
                self._fit(which, x)
            self._encode(which, x, t0)
        if not self.latent_values:  # KIVI per-token value codes
            vq = gq.quantize(vb, self.qbits, self.value_group(vb.shape[-1]))
            for name, x in zip(("v_codes", "v_scales", "v_biases"), vq):
                setattr(self, name, grow_rows(getattr(self, name), t0, x))
        self.n_quant = t0 + n

    def _latents_t(self, which: str, n: int, dtype=mx.float32) -> mx.array:
        return lr.decode_latents_t(getattr(self, f"{which}_codes"), getattr(self, f"{which}_scales"),
                                   getattr(self, f"{which}_biases"), getattr(self, f"{which}_raw"), n,
                                   self.layout(which), dtype)

    def _head_proj(self, which: str):
        """Per-head reconstruction: W [B, H, D, r] (each head's rows of the group basis), mean [B, H, 1, D]."""
        basis, mean = self._basis(which)
        B, H = basis.shape[0], self.res_k.shape[1]
        return basis.reshape(B, H, -1, basis.shape[-1]), None if mean is None else mean.reshape(B, H, 1, -1)

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

    def _key_scores(self, q: mx.array, n: int) -> mx.array:
        """``q · Kᵀ`` over the first n tokens without rebuilding keys: ``(q W_h)·Zᵀ (+ q·μ_h)``."""
        B, H, M, _ = q.shape
        W, mu = self._head_proj("k")
        zt = self._latents_t("k", n)  # [B, Hg, r, n]
        Hg = zt.shape[1]
        s = ((q @ W).reshape(B, Hg, (H // Hg) * M, -1) @ zt).reshape(B, H, M, n)
        if mu is not None:
            s = s + q @ mu.swapaxes(-1, -2)
        return s

    def _value_side(self, n: int) -> mx.array:
        """The value latents ``Z_vᵀ`` [B, Hg, r, n] (or KIVI's per-token rows)."""
        return self._latents_t("v", n) if self.latent_values else self._values(n)

    def _value_out(self, p: mx.array, n: int, side=None) -> mx.array:
        """``p · V`` over the first n tokens: ``(p Z_v) W_vᵀ (+ Σp μ_v)`` for latents (``side``: ``_value_side(n)``,
        built)."""
        side = self._value_side(n) if side is None else side
        if not self.latent_values:
            return p @ side
        B, H, M, _ = p.shape
        W, mu = self._head_proj("v")
        zt = side  # [B, Hg, r, n]
        Hg = zt.shape[1]
        pz = (p.reshape(B, Hg, (H // Hg) * M, n) @ zt.swapaxes(-1, -2)).reshape(B, H, M, -1)
        out = pz @ W.swapaxes(-1, -2)
        if mu is not None:
            out = out + p.sum(axis=-1, keepdims=True) * mu
        return out

    def _attends_returned_rows(self) -> bool:
        """On a GPU, over the returned rows (the step is bound by the host's graph building, and the latents' own
        attention built a second one: Palu 22.1 -> 44.3 tok/s on an H200, SmolLM2 at 8k, the plain cache ~175)."""
        return not blocks.on_cpu()

    def _attend_stored(self, queries, keys, values, call, *, scale, mask, sinks):
        """A decode step on the latents in one softmax (``_attend_codes`` with ``_key_scores`` / ``_value_out``), or
        on a GPU over the rows ``update_and_fetch`` returned with the fused sdpa (``_attends_returned_rows``); a
        prefill chunk as KIVI's, ``dense_attention`` over the rows rebuilt once per layer: one softmax on the latents
        built the chunk's [N, M] scores several times (4.3-5.2x the plain cache's peak, 2048 tokens in chunks of
        256)."""
        if queries.shape[2] > 1 or self._attends_returned_rows():
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        out = self._cpu_checked(queries, call, scale=scale, mask=mask, sinks=sinks) if call[0] else None
        return self._attend_codes(queries, call, scale=scale, mask=mask, sinks=sinks) if out is None else out

    def _cpu_layout(self) -> bool:
        """Whether ``_cpu_part`` reads this cache: its keys scored on the latents (not a subclass's own
        ``_key_scores``: Palu's rebuilds its pre-RoPE keys)."""
        return type(self)._key_scores is LowRankKVCache._key_scores and self.k_bits is not None

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Latents ``native/latent_cpu.cpp`` reads: kernels built, token groups dividing 64, up to 256 latent
        channels of 1-8 bits or float16 a side, up to 32 query rows a head group; values as latents, or KIVI's
        2/4/8-bit rows (one head a group, value groups of whole words, dv up to 256)."""
        widths = [*self.k_bits, *((self.v_bits or ()) if self.latent_values else ())]
        fits = (native.available() and 64 % self.group == 0 and all(b <= 8 or b == 16 for b in widths)
                and len(self.k_bits) <= 256 and (self.res_k.shape[1] // self.hg) * rep <= 32)
        if self.latent_values:
            return fits and len(self.v_bits) <= 256
        gv = self.value_group(dv)
        return (fits and self.qbits in (2, 4, 8) and self.hg == self.res_k.shape[1] and (gv * self.qbits) % 32 == 0
                and dv <= 256)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` tokens' partials for scaled float32 queries ``qf`` [B, H, M, D] by the CPU kernel: scores
        ``(q W_h)·z + q·μ_h`` on each block's decoded latents, values summed as latents (turned back here: ``@
        W_vᵀ + l μ_v``) or from KIVI's rows."""
        B, H, M, _ = qf.shape
        dv = self.res_v.shape[-1]
        qz, bias, rebuild = self._cpu_keys(qf)
        k = [getattr(self, f"k_{a}") for a in ("codes", "scales", "biases", "raw")]
        if self.latent_values:
            v = dict(v_raw=self.v_raw, v_bits=list(self.v_bits))
        else:
            v = dict(v_raw=None, v_row_bits=self.qbits, v_row_group=self.value_group(dv), dv=dv)
        m, l, acc = native.module().latent_decode(  # noqa: E741
            qz, bias, n, self.group, *k, list(self.k_bits), self.v_codes, self.v_scales, self.v_biases, **v,
            **rebuild)
        m, l, acc = m.reshape(B, H, M), l.reshape(B, H, M), acc.reshape(B, H, M, -1)
        if self.latent_values:
            Wv, mu_v = self._head_proj("v")
            acc = acc @ Wv.swapaxes(-1, -2) + (0 if mu_v is None else l[..., None] * mu_v)
        return Partials(m, l, acc)

    def _cpu_keys(self, qf):
        """(queries, bias, further arguments) of ``latent_decode``'s keys for scaled queries ``qf`` [B, H, M, D]: the
        projected queries ``q W_h`` [B, Hg, heads * M, r] and ``q·μ_h``, scored on the latents as they are."""
        B, H, M, _ = qf.shape
        W, mu = self._head_proj("k")
        qz = (qf @ W).reshape(B, self.hg, (H // self.hg) * M, -1)
        return qz, None if mu is None else (qf @ mu.swapaxes(-1, -2)).reshape(B, self.hg, -1), {}

    def _part_bytes(self, which: str) -> int:
        """Bytes of ``which``'s latents: basis, mean and the filled rows."""
        g = self.n_quant // self.group
        rows = {"basis": None, "mean": None, "codes": g, "scales": g, "biases": g, "raw": self.n_quant}
        arrays = [(getattr(self, f"{which}_{name}"), n) for name, n in rows.items()]
        return sum(a.nbytes if n is None else a.nbytes // a.shape[2] * n for a, n in arrays if a is not None)

    def _value_bytes(self) -> int:
        """Value bytes but the residual: latents, or KIVI's per-token codes."""
        if self.latent_values or self.res_v is None:
            return self._part_bytes("v")
        B, H, _, dv = self.res_v.shape
        return self._value_code_nbytes(B, H, dv)

    def _code_nbytes(self, B, H, D, dv) -> int:
        return self._part_bytes("k") + self._value_bytes()

    def _held_bytes(self, *names) -> int:
        return sum(a.nbytes for a in (getattr(self, n) for n in names) if a is not None)

    projection_bytes = property(lambda self: self._held_bytes("k_basis", "k_mean", "v_basis", "v_mean"),
                                doc="Bytes of the fitted bases and means, keys and values.")
    compressed_key_bytes = property(lambda self: self._part_bytes("k") + self._held_bytes("res_k"))
    compressed_value_bytes = property(lambda self: self._value_bytes() + self._held_bytes("res_v"))

    rank = property(lambda self: len(self.k_bits or ()),
                    doc="Latent key channels kept (uniform across heads / head groups); 0 before the fit.")
    value_rank = property(lambda self: len(self.v_bits or ()))

    @property
    def assigned_avg_bits(self) -> float:
        """Stored bits per original K and V element, everything counted; 16 = no compression."""
        fp = self.fp16_key_bytes + self.fp16_value_bytes
        return 16.0 * (self.compressed_key_bytes + self.compressed_value_bytes) / fp if fp else 16.0
