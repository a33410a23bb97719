"""VecInfer (Yao, Yang, Tong, Lin, Liu, Luan, Wang, arXiv 2510.06175): key outlier channels suppressed (per-channel
smoothing + Hadamard rotation), the result product-quantized, attention from per-query lookup tables.

On KIVI's residual (32-token blocks): keys ``k' = (k / s) @ R`` (``R`` a seeded randomized Hadamard, Haar-random
orthogonal when D is not a power of two) cut into ``key_sub_dim``-dim sub-vectors, each the nearest of
``2**key_codebook_bits`` codewords; values alike (``value_sub_dim`` / ``value_codebook_bits``), untransformed.
``s = sqrt(max |k|)`` per head and channel and one codebook per layer are fitted on the first block unless
``smooth_factors`` / ``key_codebook`` / ``value_codebook`` are given. Scores: ``q . k_hat = sum_j LUT[j, code_j]``
with ``LUT[j, c] = ((q * s) @ R)_j . C_c`` (decoded keys above ``LUT_MAX``). Prefill chunks attend the decoded
rows (``dense_attention``; ``fused_sdpa`` no longer changes them); ``fused_sdpa`` with ``fused_sdpa_memory_bound``
sends decode steps up to ``fused_sdpa_max_ctx`` there too; ``use_metal_kernels`` has no effect.

Deviations from the paper:

* Calibration is online, on each layer's first encoded block (the paper: offline); config arrays replace it.
  That block waits in the float16 residual until its codes plus the codebooks to fit are smaller than its rows
  (``_holds_back``), so a short chat holds only its float16 rows.
* Values are vector-quantized without smoothing/rotation (the transforms target key outliers).
* Keys are quantized after RoPE; the newest < 32 tokens stay float16 and a call's rows are attended in full
  precision (the paper quantizes every token). A decode step on the CPU reads the codes in TurboQuant-RVQ's CPU
  kernel (``native/turboquant_rvq_cpu.cpp``, ``_cpu_part``: a side's code planes one index into its codebook, keys
  scored against its codewords or a table of them, values' weights summed per (sub-vector, codeword)); elsewhere (a
  GPU, per-head codebooks) the LUT gather is plain MLX ops; a prefill chunk attends the decoded rows
  (``attention.dense_attention``).
* Trim: exact for residual tokens and whole blocks; a trim into the calibration block raises ``ValueError``
  unless it removes every encoded token (then calibration is redone).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ... import native
from ...base import register
from ...contract import CompressedKVCache, register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives import bitpack, blocks
from ...primitives.buffers import grow_rows
from ...primitives.vq import fit_codebook, pack_codes, unpack_codes, vq_assign  # noqa: F401 (a2ats, tests)
from ...primitives.rotation import random_orthogonal, randomized_hadamard
from ...window import Partials
from .kivi import KIVIKVCache

BLOCK = 32  # tokens per encoded block (= the float16 residual's capacity)
LUT_MAX = 1 << 25  # gathered LUT entries above which scores use dequantized keys


def _to_head_rows(x: mx.array, hc: int, sub: int) -> mx.array:
    """[B, H, n, D] -> sub-vector rows [Hc, B*n*D/sub (*H if Hc == 1), sub]."""
    return x.reshape(1, -1, sub) if hc == 1 else x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, sub)


def _lookup(codes: mx.array, cb: mx.array) -> mx.array:
    """Codewords of ``codes [B, H, n, m]`` from ``cb [Hc, K, d]`` -> [B, H, n, m*d] float32."""
    Hc, K, d = cb.shape
    B, H, n, m = codes.shape
    flat = codes if Hc == 1 else codes + (mx.arange(H, dtype=mx.int32) * K)[None, :, None, None]
    return mx.take(cb.reshape(Hc * K, d).astype(mx.float32), flat, axis=0).reshape(B, H, n, m * d)


def _as_array(v, name, ndims):
    a = mx.array(np.asarray(v, dtype=np.float32))
    if a.ndim not in ndims:
        raise QuantizerConfigError(name, getattr(v, "shape", v), f"an array with {' or '.join(map(str, ndims))} dims")
    return a


@register_with_mlx_lm
@register("vecinfer")
class VecInferKVCache(KIVIKVCache):
    """VecInfer: smoothing + Hadamard on keys, product VQ of keys and values, LUT attention on codes."""
    chunk_invariant = False  # smoothing factors and codebooks fitted on the first encoded block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a block

    array_fields = ("k_lo", "k_hi", "v_lo", "v_hi", "key_cb", "val_cb", "smooth", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "calib_tokens")
    dequant_only = "vector-quantized codes"
    calib_tokens = 0  # encoded tokens the fitted statistics were computed from (0: none fitted)
    calib_field, refit_fields = "calib_tokens", ("key_cb", "val_cb", "smooth")  # emptied codes: calibrate again

    def _init_layout(self):
        c, o = self.config, self.config.options
        self.ks, self.vs = int(c.key_sub_dim), int(c.value_sub_dim)
        self.kbits, self.vbits = int(c.key_codebook_bits), int(c.value_codebook_bits)
        self.group, self.qbits = BLOCK, self.kbits  # qbits: informational (KIVI's attribute name)
        self._given = {}
        for name, field, dims in (("smooth", "smooth_factors", (1, 2)), ("key_cb", "key_codebook", (2, 3)),
                                  ("val_cb", "value_codebook", (2, 3))):
            v = getattr(o, field)
            if v is not None:
                a = _as_array(v, field, dims)
                if field != "smooth_factors":
                    sub, bits = (self.ks, self.kbits) if field == "key_codebook" else (self.vs, self.vbits)
                    if a.shape[-1] != sub or a.shape[-2] > (1 << bits):
                        raise QuantizerConfigError(field, tuple(a.shape),
                                                   f"[K, {sub}] or [H, K, {sub}] with K <= 2**{bits}")
                    a = a if a.ndim == 3 else a[None]
                elif bool(mx.any(a <= 0)):
                    raise QuantizerConfigError(field, "non-positive entries", "positive factors")
                self._given[name] = a

    def _holds_back(self, total: int, d: int, dv: int) -> bool:
        """Checks the sub-vector dims against the head dims; before calibration, rows wait in the float16 residual
        until their codes plus the codebooks and smoothing factors to fit take fewer bytes than the rows."""
        for field, sub, dim in (("key_sub_dim", self.ks, d), ("value_sub_dim", self.vs, dv)):
            if dim % sub:
                raise QuantizerConfigError(field, sub, f"a divisor of the {field[:-8]} head dim {dim}")
        if self.key_cb is not None:
            return False
        B, H = self.res_k.shape[:2]
        fitted = 4 * H * d * ("smooth" not in self._given)
        for name, sub, bits in (("key_cb", self.ks, self.kbits), ("val_cb", self.vs, self.vbits)):
            fitted += 2 * (1 << bits) * sub * (name not in self._given)
        nq, fp16 = total // BLOCK * BLOCK, B * H * 2 * (d + dv)  # encodable rows; float16 bytes per token
        # encoded: codebooks + the 32-row residual + codes; held back: the rows. Both with grow_rows' spare.
        encoded = fitted + BLOCK * fp16 + B * H * (nq + max(16, nq // 8)) * self.bytes_per_token_budget(d, dv)
        return encoded >= (total + max(16, total // 8)) * fp16

    def _rot(self, d: int) -> mx.array:
        return (randomized_hadamard if d & (d - 1) == 0 else random_orthogonal)(d, int(self.config.seed))

    def _calibrate(self, kb: mx.array, vb: mx.array) -> None:
        B, H, n, D = kb.shape
        k32 = kb.astype(mx.float32)
        if "smooth" in self._given:
            s = self._given["smooth"]
            if s.shape[-1] != D or (s.ndim == 2 and s.shape[0] != H):
                raise QuantizerConfigError("smooth_factors", tuple(s.shape), f"[{D}] or [{H}, {D}]")
            s = mx.broadcast_to(s.reshape(-1, D), (H, D))
        else:
            s = mx.sqrt(mx.maximum(mx.abs(k32).max(axis=(0, 2)), 1e-4))  # [H, D]
        self.smooth = s.astype(mx.float32)
        for name, x, sub, bits in (("key_cb", self._transform(k32), self.ks, self.kbits),
                                   ("val_cb", vb.astype(mx.float32), self.vs, self.vbits)):
            if name in self._given:
                cb = self._given[name]
                if cb.shape[0] not in (1, H):
                    raise QuantizerConfigError("key_codebook" if name == "key_cb" else "value_codebook",
                                               tuple(cb.shape), f"[K, {sub}] or [{H}, K, {sub}]")
            else:
                cb = fit_codebook(_to_head_rows(x, 1, sub), 1 << bits, int(self.config.seed) + (name == "val_cb"))
            setattr(self, name, cb.astype(mx.float16))
        self.calib_tokens = n

    def _transform(self, k32: mx.array) -> mx.array:
        """Smoothing + rotation: ``(k / s) @ R`` for keys [B, H, n, D] (float32)."""
        return (k32 / self.smooth[None, :, None, :]) @ self._rot(k32.shape[-1])

    def _encode(self, x: mx.array, cb: mx.array, sub: int) -> mx.array:
        """Codes [B, H, n, D/sub] of ``x`` (``_to_head_rows`` undone)."""
        B, H, n, D = x.shape
        codes = vq_assign(_to_head_rows(x, cb.shape[0], sub), cb)
        return codes.reshape(B, H, n, D // sub) if cb.shape[0] == 1 else codes.reshape(H, B, n, -1).swapaxes(0, 1)

    def _append_groups(self, kb, vb):
        if self.key_cb is None:
            self._calibrate(kb, vb)
        t0 = self.n_quant
        kc = self._encode(self._transform(kb.astype(mx.float32)), self.key_cb, self.ks)
        vc = self._encode(vb.astype(mx.float32), self.val_cb, self.vs)
        for side, codes, bits in (("k", kc, self.kbits), ("v", vc, self.vbits)):
            for part, arr in zip(("lo", "hi"), pack_codes(codes, bits)):  # hi: None for <= 8 bits
                if arr is not None:
                    setattr(self, f"{side}_{part}", grow_rows(getattr(self, f"{side}_{part}"), t0, arr))
        self.n_quant = t0 + kb.shape[2]

    def _codes(self, side: str, n: int) -> mx.array:
        lo, hi = getattr(self, f"{side}_lo")[:, :, :n], getattr(self, f"{side}_hi")
        sub, bits, res = (self.ks, self.kbits, self.res_k) if side == "k" else (self.vs, self.vbits, self.res_v)
        return unpack_codes(lo, None if hi is None else hi[:, :, :n], bits, res.shape[-1] // sub)

    def _keys_t(self, n, dtype=mx.float32):
        """Dequantized K^T [B, H, D, n]: codewords, rotated back, times the smoothing factors."""
        kt = _lookup(self._codes("k", n), self.key_cb)  # transformed space [B, H, n, D]
        k = (kt @ self._rot(kt.shape[-1]).T) * self.smooth[None, :, None, :]
        return k.swapaxes(-1, -2).astype(dtype)

    def _values(self, n, dtype=mx.float32):
        return _lookup(self._codes("v", n), self.val_cb).astype(dtype)

    def lut_scores(self, q: mx.array, n: int) -> mx.array:
        """``q [B, H, Q, D]`` (already scaled) against the first ``n`` VQ keys -> [B, H, Q, n], as
        ``sum_j LUT[j, code_j]`` with ``LUT = (q * s) @ R`` split in sub-vectors times the codebook."""
        B, H, Q, D = q.shape
        m, sub = D // self.ks, self.ks
        qt = ((q.astype(mx.float32) * self.smooth[None, :, None, :]) @ self._rot(D)).reshape(B, H, Q, m, sub)
        cb = self.key_cb.astype(mx.float32)  # [Hc, K, sub]
        lut = qt @ cb[None, :, None].swapaxes(-1, -2)  # [B, H, Q, m, K]
        codes = self._codes("k", n).transpose(0, 1, 3, 2)[:, :, None]  # [B, H, 1, m, n]
        idx = mx.broadcast_to(codes, (B, H, Q, m, n))
        return mx.take_along_axis(lut, idx, axis=-1).sum(axis=3)

    def _fused(self, N: int, M: int) -> bool:
        o = self.config.options
        within = o.fused_sdpa_max_ctx is None or M <= o.fused_sdpa_max_ctx
        return bool(o.fused_sdpa) and within and (N > 1 or bool(o.fused_sdpa_memory_bound))

    def _attends_returned_rows(self) -> bool:
        """On a GPU, over the returned rows (the LUT step built a second decoding graph on a host-bound step: 18.4 ->
        57.8 tok/s on an H200, SmolLM2 at 8k, the plain cache ~175)."""
        return not blocks.on_cpu()

    def _attend_stored(self, queries, keys, values, call, *, scale, mask, sinks):
        """A decode step on the codes unless the fused sdpa path is chosen or, on a GPU, the rows
        ``update_and_fetch`` returned are attended (``_attends_returned_rows``): on the CPU by the RVQ kernel
        (``_cpu_checked``: checked once against the op path) where it reads the codes, else LUT scores as MLX ops
        (``_attend_codes``); a prefill chunk as KIVI's,
        ``dense_attention`` over the rows decoded once per layer (the LUT gather of a chunk, [B, H, N, D/sub, M]
        float32 up to ``LUT_MAX``, held 13x the plain cache's peak, 2048 tokens in chunks of 256)."""
        if call[0] == 0 or queries.shape[2] > 1 or self._fused(1, keys.shape[2]) or self._attends_returned_rows():
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        out = self._cpu_checked(queries, call, scale=scale, mask=mask, sinks=sinks)  # None: not the CPU kernel's
        return self._attend_codes(queries, call, scale=scale, mask=mask, sinks=sinks) if out is None else out

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: TurboQuant-RVQ's CPU kernel over the code planes, one joint codebook a side

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes the RVQ CPU kernel reads (its joint sides): one codebook a layer (per-head ones: the op path), the
        values' bins (sub-vectors x codewords) up to 2**16, head dims up to 256, up to 32 query heads a KV head.
        Fused-sdpa steps never get here (``_attend_stored`` routes them first)."""
        return (native.available() and self.attend_path == "auto" and self.key_cb is not None
                and self.key_cb.shape[0] == 1 and self.val_cb.shape[0] == 1 and (dv // self.vs) << self.vbits <= 1 << 16
                and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` coded tokens' partials for scaled float32 queries ``qf`` [B, H, R, D]: the kernel scores
        ``((q * s) @ R) . c`` per sub-vector (``lut_scores``' query), each side's low and high code planes one index
        into its codebook (a given codebook short of ``2**bits`` rows padded), no norms (unit: shape [B, H, 0]); acc
        is in the values' own domain."""
        B, H, _, D = qf.shape
        unit, no_sigma = mx.zeros((B, H, 0), mx.float16), mx.zeros((0,), mx.float32)

        def side(p, cb, bits):
            cb = cb[0] if cb.shape[1] == 1 << bits else mx.pad(cb[0], [(0, (1 << bits) - cb.shape[1]), (0, 0)])
            return getattr(self, f"{p}_lo"), getattr(self, f"{p}_hi"), unit, cb, no_sigma, None

        qt = (qf * self.smooth[None, :, None, :]) @ self._rot(D)
        m, l, acc = native.module().turboquant_rvq_decode(  # noqa: E741
            qt, *side("k", self.key_cb, self.kbits), *side("v", self.val_cb, self.vbits), n, self.res_v.shape[-1],
            counts=list(counts), k_joint=True, v_joint=True)
        return Partials(m, l, acc)

    def _key_scores(self, q, n):
        """LUT scores on the codes while the table stays small (``LUT_MAX``), else the decoded keys."""
        B, H, R, D = q.shape
        return self.lut_scores(q, n) if R * (D // self.ks) * n <= LUT_MAX else q @ self._keys_t(n)

    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        return (d // self.ks) * self.kbits / 8 + (dv // self.vs) * self.vbits / 8

    def _code_nbytes(self, B, H, D, Dv) -> int:
        per = sum(bitpack.packed_nbytes(m, min(bits, 8)) + (bitpack.packed_nbytes(m, bits - 8) if bits > 8 else 0)
                  for lo, m, bits in ((self.k_lo, D // self.ks, self.kbits), (self.v_lo, Dv // self.vs, self.vbits))
                  if lo is not None)
        fixed = sum(a.nbytes for a in (self.key_cb, self.val_cb, self.smooth) if a is not None)
        return B * H * self.n_quant * per + fixed
