"""GEAR (Kang, Zhang, Kundu, Jeong, Liu, Krishna, Zhao, arXiv 2403.05527): X ≈ D̂ + L + S, with S the largest-|x|
entries kept exactly, D̂ = Quant_b(X − S) and L = A·Bᵀ a rank-r fit of the rest.

Per (batch, head, G-token group) on KIVI's residual: S = ``ceil(gear_sparse_fraction·G·D)`` entries (uint16 index
+ float16 value), D̂ = KIVI's codes, L = a rank-r fit by power (subspace) iteration, as the paper's solver (A per
token, Bᵀ per group, float16; ``lowrank_fit.power_lowrank``); values alike with
``gear_quantize_values``. r = ``gear_rank`` or, from the first block, the smallest rank whose fit keeps
``gear_energy_threshold`` of every group's residual energy, capped at min(G, D) // 8 (a b-bit residual is noise-like).

Deviations from the paper: the residual is fitted per G-token group (the paper: per head over the prefill, then
per decode buffer); keys are quantized after RoPE; the base quantizer is KIVI's (GEAR-KIVI); the newest < G
tokens stay float16 (the paper's streaming buffer); ``lowrank_fit.POWER_ITERS`` subspace iterations from a fixed
Gaussian start (the paper: power iteration, its count unstated) capture 0.98-0.995 of the exact SVD's energy; the rank
from the energy threshold is read off the first block's fit at the cap (``lowrank_fit.fit_energies``: the smallest r
whose first r fitted components hold the threshold in every group), not an SVD: subspace iteration finds at most the
SVD's energy in its first r columns, so the rank is never below the SVD's and it is what the kept columns capture.
Until session 36 it came from an exact SVD of the first block on the CPU (MLX's SVD is CPU-only): 0.78 of GEAR's
1.19 s prefill on an H100 (llama-8b x 8 layers, 8192 tokens), against the plain cache's 0.06 s. A trim keeping part of
that first block raises ValueError (``calib_end``: the kept groups' factors have the rank the whole block gave).
A CPU decode step (quantized values, 2/4/8-bit codes) reads the codes in KIVI's CPU kernel, which puts the outliers
back into each decoded block and adds the low-rank term in its products (``_cpu_part``), where other steps
reconstruct every row first.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import blocks
from ...primitives import groupquant as gq
from ...primitives import lowrank_fit as lr
from ...primitives import nonuniform as nu
from ...primitives.buffers import grow_columns, grow_rows
from ...window import Partials
from .kivi import KIVIKVCache


class SparseOutliers:
    """Dense-and-sparse storage (gear, kvquant): per G-token block of d channels the ``_n_out(d)`` largest |x|
    (a ``frac`` of the entries), kept exactly in ``{side}_oidx`` / ``{side}_oval``, one column block per group."""

    def _n_out(self, d: int) -> int:
        return math.ceil(self.frac * self.group * d) if self.frac > 0 else 0

    def _put_outliers(self, side: str, g0: int, idx, val, cap: int) -> None:
        """Store the outliers ``idx``/``val [B, H, g, o]`` of groups ``g0 ..`` (``cap`` groups of capacity)."""
        B, H, g, o = idx.shape
        for name, a in (("oidx", idx), ("oval", val)):
            setattr(self, f"{side}_{name}", grow_columns(getattr(self, f"{side}_{name}"), g0 * o,
                                                       a.reshape(B, H, g * o), cap * o))

    def _with_outliers(self, side: str, x: mx.array, d: int) -> mx.array:
        """Blocks ``x [B, H, g, G * d]`` with the stored outliers of their groups written back."""
        B, H, g = x.shape[:3]
        o, idx = self._n_out(d), getattr(self, f"{side}_oidx")
        if not o or idx is None:
            return x
        stored = (a[..., : g * o].reshape(B, H, g, o) for a in (idx, getattr(self, f"{side}_oval")))
        return nu.scatter_outliers(x, *stored)


@register_with_mlx_lm
@register("gear")
class GEARKVCache(SparseOutliers, KIVIKVCache):
    """GEAR: KIVI-style b-bit base + rank-r residual + exact sparse outliers, keys and values."""
    chunk_invariant = False  # low-rank width chosen on the first quantized block (unless gear_rank is set)
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = ("k_codes", "k_scales", "k_biases", "k_oidx", "k_oval", "k_a", "k_bt", "k_err_base", "k_err_gear",
                    "v_codes", "v_scales", "v_biases", "v_oidx", "v_oval", "v_a", "v_bt", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "rank", "calib_end")
    dequant_only = "low-rank and sparse corrections on top of the codes"
    rank = -1  # resolved low-rank width (-1: not yet, from the energy threshold at the first block)
    # tokens of the first block the threshold's rank was read from (0: a given rank): a trim into them raises, as
    # the kept groups' factors have that rank (a cache fed only the kept tokens could take another)
    calib_end, calib_field = 0, "calib_end"

    def _init_layout(self):
        o = self.config.options
        self.qbits, self.group, self.frac = o.bits, o.group_size, float(o.sparse_fraction)
        self.rank = -1 if o.rank is None else o.rank

    def _gear_block(self, x, per_channel: bool):
        """x [B, H, g, G, D] float32 -> (base codes, outlier indices, outlier values, A, Bt, reconstruction)."""
        B, H, g, G, D = x.shape
        b, ko = self.qbits, self._n_out(D)
        idx, vals, dense = nu.split_outliers(x.reshape(B, H, g, G * D), ko)
        dense = dense.reshape(B, H, g * G, D)
        quant, dequant = (gq.quantize_per_channel, gq.dequantize_per_channel) if per_channel else \
            (gq.quantize, gq.dequantize)
        gv = G if per_channel else math.gcd(D, G)  # keys per channel over the group, values per token
        q = quant(dense, b, gv)
        approx = dequant(*q, b, gv).reshape(B, H, g, G * D)
        approx = (nu.scatter_outliers(approx, idx, vals) if ko else approx).reshape(B, H, g, G, D)
        resid = x - approx
        if self.rank < 0:  # resolve once, on the first block: the fit at the cap, cut where it holds the threshold
            cap = max(1, min(G, D) // 8)
            a, bt = lr.power_lowrank(resid, cap)
            r = min(lr.energy_rank(lr.fit_energies(resid, bt), self.config.options.energy_threshold), cap)
            self.rank, a, bt = r, a[..., :r], bt[..., :r, :]
        elif self.rank:
            a, bt = lr.power_lowrank(resid, self.rank)
        if not self.rank:
            return q, idx, vals, None, None, approx
        a, bt = a.astype(mx.float16), bt.astype(mx.float16)
        return q, idx, vals, a, bt, approx + a.astype(mx.float32) @ bt.astype(mx.float32)

    def _store(self, keys, values):
        """KIVI's, then ``blocks.settle_prefill``: a prefill call waits for the cache's arrays, so the fits are
        done before the layer's attention is queued (left to the chunk's end, every layer's rows and SVD
        temporaries were alive together: SmolLM2, 1023 tokens in one chunk, 1.44x the plain cache's peak)."""
        super()._store(keys, values)
        blocks.settle_prefill(keys.shape[2], self.held_arrays)

    def _short_steps(self) -> bool:
        return True  # ``_store`` adds only a prefill wait: a decode row completing no group may skip it

    def _append_groups(self, kb, vb):
        G, b = self.group, self.qbits
        (B, H, n, D), Dv = kb.shape, vb.shape[-1]
        g, t0 = n // G, self.n_quant
        g0 = t0 // G
        xk = kb.astype(mx.float32).reshape(B, H, g, G, D)
        if self.rank < 0:
            self.calib_end = t0 + n
        kq, kidx, kval, ka, kbt, krec = self._gear_block(xk, per_channel=True)
        base = gq.dequantize_per_channel(*gq.quantize_per_channel(kb, b, G), b, G).reshape(B, H, g, G, D)
        if self.config.options.quantize_values:
            vq, vidx, vval, va, vbt, _ = self._gear_block(vb.astype(mx.float32).reshape(B, H, g, G, Dv), False)
        else:
            vq, vidx, vval, va, vbt = gq.quantize(vb, b, self.value_group(Dv)), None, None, None, None
        self._append_codes(t0, kq, vq)  # per-group arrays below follow the values' capacity too
        cap, r = self.v_codes.shape[2] // G, self.rank
        for name, rec in (("k_err_base", base), ("k_err_gear", krec)):  # squared key error per group
            setattr(self, name, grow_columns(getattr(self, name), g0, ((xk - rec) ** 2).sum(axis=(0, 1, 3, 4)), cap))
        for side, idx, val, a, bt, d in (("k", kidx, kval, ka, kbt, D), ("v", vidx, vval, va, vbt, Dv)):
            if idx is not None and self._n_out(d):
                self._put_outliers(side, g0, idx, val, cap)
            if a is not None:
                setattr(self, f"{side}_a", grow_rows(getattr(self, f"{side}_a"), t0, a.reshape(B, H, n, r)))
                setattr(self, f"{side}_bt", grow_columns(getattr(self, f"{side}_bt"), g0 * r * d,
                                                       bt.reshape(B, H, g * r * d), cap * r * d))
        self.n_quant = t0 + n

    def _decode(self, side: str, n: int, base: mx.array) -> mx.array:
        """base [B, H, n, d] float32 (dequantized codes) + sparse outliers + low-rank part."""
        B, H, _, d = base.shape
        G, g, r, a = self.group, n // self.group, self.rank, getattr(self, f"{side}_a")
        x = self._with_outliers(side, base.reshape(B, H, g, G * d), d).reshape(B, H, g, G, d)
        if r > 0 and a is not None:
            af = a[:, :, :n].astype(mx.float32).reshape(B, H, g, G, r)
            bt = getattr(self, f"{side}_bt")[..., : g * r * d].astype(mx.float32).reshape(B, H, g, r, d)
            x = x + af @ bt
        return x.reshape(B, H, n, d)

    def _keys_t(self, n, dtype=mx.float32):
        base = super()._keys_t(n, mx.float32).swapaxes(-1, -2)
        return self._decode("k", n, base).swapaxes(-1, -2).astype(dtype)

    def _values(self, n, dtype=mx.float32):
        base = super()._values(n, mx.float32)
        return (self._decode("v", n, base) if self.config.options.quantize_values else base).astype(dtype)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: KIVI's CPU kernel on the codes, the corrections applied in it

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        return self.config.options.quantize_values and super()._cpu_codes_fit(d, dv, rep)

    def _cpu_part(self, qf, n: int, counts=()):
        """The first ``n`` quantized tokens by KIVI's CPU kernel with GEAR's corrections (``fixes``): the outliers put
        back into each decoded block, the low-rank term added in the block's products (as ``_decode`` rebuilds rows)."""
        d, dv = qf.shape[-1], self.res_v.shape[-1]
        r = max(self.rank, 0) if self.k_a is not None else 0
        sizes = [r, self._n_out(d) if self.k_oidx is not None else 0, self._n_out(dv) if self.v_oidx is not None else 0]
        if not any(sizes):
            return super()._cpu_part(qf, n)
        fixes = [getattr(self, f"{s}_{a}") if (sizes[0] if a in ("a", "bt") else sizes[1 + (s == "v")]) else None
                 for s in "kv" for a in ("a", "bt", "oidx", "oval")]
        arrays = [getattr(self, f"{s}_{a}") for s in "kv" for a in ("codes", "scales", "biases")]
        m, l, acc = native.module().kivi_decode(  # noqa: E741
            qf, *arrays, n, self.qbits, self.group, self.value_group(dv), dv, fixes=fixes, fix_sizes=sizes)
        return Partials(m, l, acc)

    def _side_bytes(self, side: str, error_feedback: bool) -> int:
        if self.res_k is None:
            return 0
        B, H, n = *self.res_k.shape[:2], self.n_quant
        d, g = (self.res_k if side == "k" else self.res_v).shape[-1], n // self.group
        base = B * H * d * g * (4 * self._key_words() + 4) if side == "k" else self._value_code_nbytes(B, H, d)
        if not error_feedback or (side == "v" and not self.config.options.quantize_values):
            return base
        r = max(self.rank, 0)
        return base + B * H * (g * self._n_out(d) * 4 + n * r * 2 + g * r * d * 2)

    # codes + scales/biases (+ low-rank factors and outliers; base_only: without that error feedback)
    compressed_key_bytes = property(lambda self: self._side_bytes("k", True))
    compressed_value_bytes = property(lambda self: self._side_bytes("v", True))
    base_only_key_bytes = property(lambda self: self._side_bytes("k", False))
    base_only_value_bytes = property(lambda self: self._side_bytes("v", False))

    @property
    def assigned_avg_bits(self) -> float:
        """Key bits per quantized element including the error-feedback overhead."""
        if not self.n_quant:
            return 0.0
        B, H, _, D = self.res_k.shape
        return 8.0 * self.compressed_key_bytes / (B * H * self.n_quant * D)

    @property
    def error_recovery_ratio(self) -> float:
        """1 − ‖K − GEAR(K)‖² / ‖K − base(K)‖² over the stored key groups (measured at encode time)."""
        g = self.n_quant // self.group
        if not g:
            return 0.0
        eb = float(self.k_err_base[:g].sum())
        return 1.0 - float(self.k_err_gear[:g].sum()) / eb if eb > 0 else 0.0

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        return self.compressed_key_bytes + self.compressed_value_bytes + self.n_quant // self.group * 8

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        G, r = self.group, max(self.rank, 0)
        sides = (d, dv) if self.config.options.quantize_values else (d,)  # sparse outliers + rank-r factors
        return self.kivi_bytes_per_token(d, dv) + sum(4 * self._n_out(x) / G + 2 * r + 2 * r * x / G for x in sides)

    def _trim_rows(self, n):
        dropped = super()._trim_rows(n)
        if self.n_quant == 0 and self.config.options.rank is None:
            self.rank = -1  # re-resolved from the next first block, as for a fresh cache
        return dropped
