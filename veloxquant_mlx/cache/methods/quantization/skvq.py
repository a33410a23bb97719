"""SKVQ (Duanmu et al., arXiv 2405.06219): channels of similar range reordered into one group, each group quantized
per token over its range shrunk by a searched clip ratio; a sliding window of recent tokens plus a few sinks
stay exact.

The first ``skvq_n_sink`` tokens are float16 sinks; the newest sit in a float16 window of up to W + g rows (W =
``skvq_window``, g = gcd(D, ``skvq_group_size``)); when full, all but the newest W are quantized (keys at
``skvq_bits_key``, values at ``skvq_bits_value`` bits, per token in g-channel groups after a per-head permutation,
each group clipped by its alpha). The first quantized block calibrates: channels sorted by range, alpha searched
among ``skvq_clip_alpha`` * (1, 0.95, ..., 0.5) per head and group (``skvq_clip_search``). Measured (RESULTS.md's
command): reordering + clip search remove a quarter of the KL at the same bytes (window 32: 0.243 vs 0.321).

Deviations from the paper: reordering sorts by range and cuts equal groups (the paper clusters ranges: same
intent); calibration is online on each layer's first quantized block, alpha per head and group; ``skvq_max_ctx``
is accepted and unused (buffers grow on demand); the window is flushed g tokens at a time (W..W+g-1 exact tokens,
the paper exactly W), its tokens leave after the step's attention; attention dequantizes (permuted channels), but
a CPU decode step reads the codes in KIVI's CPU kernel (keys as rows: ``_cpu_part``) where both widths agree;
trim drops window rows only, deeper trims raise ``ValueError``, and it is not exact when the trimmed tokens
pushed older ones out of the window (those stay quantized).
"""

from __future__ import annotations

import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import groupquant as gq
from ...primitives.buffers import MIN_GROW, dtype_name, grow_rows
from ...window import Partials
from .kivi import RES_DTYPE, KIVIKVCache
from .kivi_sink import SinkRows

CLIP_GRID = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5


def range_permutation(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x [B, H, T, D]`` -> (perm, inv) int32 [H, D]: channels by ascending range over (B, T)."""
    xf = x.astype(mx.float32)
    perm = mx.argsort(xf.max(axis=(0, 2)) - xf.min(axis=(0, 2)), axis=-1).astype(mx.int32)
    return perm, mx.argsort(perm, axis=-1).astype(mx.int32)


def permute_channels(x: mx.array, perm: mx.array) -> mx.array:
    """``x [B, H, T, D]`` with its last axis gathered by ``perm [H, D]`` (per head)."""
    return mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)


def _bounds(xg: mx.array, alpha: mx.array):
    lo, hi = xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True)
    c, h = (hi + lo) * 0.5, (hi - lo) * 0.5 * alpha
    return c - h, c + h


def clip_to_alpha(x: mx.array, group: int, alpha: mx.array) -> mx.array:
    """``x [B, H, T, D]`` clipped per (token, channel group) to its range shrunk by ``alpha [H, D/group]``
    about the centre (``alpha`` = 1: unchanged)."""
    B, H, T, D = x.shape
    xg = x.astype(mx.float32).reshape(B, H, T, D // group, group)
    return mx.clip(xg, *_bounds(xg, alpha[None, :, None, :, None])).reshape(B, H, T, D)


def search_clip(x: mx.array, bits: int, group: int, candidates) -> mx.array:
    """``alpha [H, D/group]`` (float32): per head and channel group, the candidate minimising the squared
    error of the clipped min/max quantize-dequantize (float32) over the block ``x [B, H, T, D]``."""
    B, H, T, D = x.shape
    a = mx.array(list(candidates), dtype=mx.float32)
    xg = x.astype(mx.float32).reshape(1, B, H, T, D // group, group)
    lo, hi = _bounds(xg, a.reshape(-1, 1, 1, 1, 1, 1))
    s = (hi - lo) / float(2**bits - 1)
    fake = gq.affine_codes(xg, lo, s, bits).astype(mx.float32) * s + lo  # s = 0: the group is constant, code 0
    return a[mx.argmin(((fake - xg) ** 2).sum(axis=(1, 3, 5)), axis=0)]  # err [A, H, ng]


@register_with_mlx_lm
@register("skvq")
class SKVQKVCache(SinkRows, KIVIKVCache):
    """SKVQ: reordered, clipped per-token group quantization; float16 sinks and sliding window."""
    # channel order and clip ratios calibrated on the first quantized block; the float16 window is
    # cut to W rows by a prefill call but holds W..W+g-1 between decode flushes
    chunk_invariant = False
    exact_trim = False  # returns n, but rows the trimmed rows pushed out of the window stay quantized
    trim_exact_or_raises = False
    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "res_k", "res_v",
                    "sink_k", "sink_v", "k_perm", "k_inv", "v_perm", "v_inv", "k_alpha", "v_alpha")
    scalar_fields = KIVIKVCache.scalar_fields + ("n_sink",)
    dequant_only = "permuted, clipped channels"

    def _init_layout(self):
        o = self.config.options
        self.kbits, self.vbits, self.group = o.bits_key, o.bits_value, o.group_size
        self.window, self.n_sink_cap = o.window, o.n_sink
        self.alpha, self.reorder, self.clip_search = float(o.clip_alpha), o.reorder, o.clip_search
        self.qbits = self.kbits

    def _calibrate(self, x: mx.array, bits: int):
        B, H, T, D = x.shape
        g = self.value_group(D)
        if self.reorder:
            perm, inv = range_permutation(x)
        else:
            perm = inv = mx.broadcast_to(mx.arange(D, dtype=mx.int32)[None], (H, D))
        if self.clip_search:
            alpha = search_clip(permute_channels(x, perm), bits, g, [self.alpha * r for r in CLIP_GRID])
        else:
            alpha = mx.full((H, D // g), self.alpha, dtype=mx.float32)
        return perm, inv, alpha

    def _encode(self, x, bits, perm, alpha):
        g = self.value_group(x.shape[-1])
        return gq.quantize(clip_to_alpha(permute_channels(x, perm), g, alpha), bits, g)

    def _decode(self, side: str, m: int, dtype) -> mx.array:
        bits, inv = (self.kbits, self.k_inv) if side == "k" else (self.vbits, self.v_inv)
        codes, scales, biases = (getattr(self, f"{side}_{a}")[:, :, :m] for a in ("codes", "scales", "biases"))
        x = gq.dequantize(codes, scales, biases, bits, self.value_group(inv.shape[-1]), dtype)
        return permute_channels(x, inv)

    def _append_groups(self, kb, vb):
        """Quantize a block of tokens leaving the window (any count) and append them."""
        if self.k_perm is None:
            self.k_perm, self.k_inv, self.k_alpha = self._calibrate(kb, self.kbits)
            self.v_perm, self.v_inv, self.v_alpha = self._calibrate(vb, self.vbits)
        t0 = self.n_quant
        kq = self._encode(kb, self.kbits, self.k_perm, self.k_alpha)
        vq = self._encode(vb, self.vbits, self.v_perm, self.v_alpha)
        for name, arr in zip(("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases"), (*kq, *vq)):
            setattr(self, name, grow_rows(getattr(self, name), t0, arr))
        self.n_quant = t0 + kb.shape[2]

    def _store(self, keys, values):
        (B, H, N, D), dv = keys.shape, values.shape[-1]
        self.dtype_name = dtype_name(keys.dtype)
        cap = self.window + self.value_group(D)
        q0 = self.n_sink + self.n_quant
        take = self._take_sinks(keys, values)
        self._reserve_window(min(cap, max(1, self.n_res + N - take)), cap, B, H, D, dv)
        r0 = self.n_res
        past_k, past_v = (self.res_k[:, :, :r0], self.res_v[:, :, :r0]) if r0 else (None, None)
        self._call = (q0, r0, past_k, past_v, keys, values)
        n = N - take
        if n == 0:
            return
        k16, v16 = (x[:, :, take:].astype(RES_DTYPE) for x in (keys, values))
        total = r0 + n
        if total < cap:
            self.res_k[:, :, r0:total] = k16
            self.res_v[:, :, r0:total] = v16
            self.n_res = total
            return
        allk = k16 if r0 == 0 else mx.concatenate([past_k, k16], axis=2)
        allv = v16 if r0 == 0 else mx.concatenate([past_v, v16], axis=2)
        f = total - self.window  # all but the newest W leave the window
        self._append_groups(allk[:, :, :f], allv[:, :, :f])
        if self.window:
            self.res_k[:, :, : self.window] = allk[:, :, f:]
            self.res_v[:, :, : self.window] = allv[:, :, f:]
        self.n_res = self.window

    def _reserve_window(self, need: int, cap: int, B: int, H: int, D: int, dv: int) -> None:
        """Room for ``need`` <= ``cap`` (W + g) window rows, grown as ``grow_rows`` grows (short chats: own rows)."""
        if need <= (0 if self.res_k is None else self.res_k.shape[2]):
            return
        rows = min(cap, need + max(MIN_GROW, need // 8))
        k = mx.zeros((B, H, rows, D), dtype=RES_DTYPE)
        v = mx.zeros((B, H, rows, dv), dtype=RES_DTYPE)
        if self.n_res:
            k[:, :, : self.n_res] = self.res_k[:, :, : self.n_res]
            v[:, :, : self.n_res] = self.res_v[:, :, : self.n_res]
        self.res_k, self.res_v = k, v

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return self._after_sinks(self.sink_k, n, lambda m: self._decode("k", m, dtype), dtype).swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        return self._after_sinks(self.sink_v, n, lambda m: self._decode("v", m, dtype), dtype)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: KIVI's CPU kernel with the keys as rows, in the calibrated channel order

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes KIVI's CPU kernel reads as rows: keys and values of one width (2, 4 or 8 bits), each channel group
        whole words, head dims up to 256, up to 32 query heads a KV head."""
        b = self.kbits
        return (native.available() and self.attend_path == "auto" and b == self.vbits and b in (2, 4, 8)
                and (self.value_group(d) * b) % 32 == 0 and (self.value_group(dv) * b) % 32 == 0
                and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()):
        """The first ``n`` quantized tokens by KIVI's CPU kernel, its keys read as rows (``key_rows``): the queries
        in the keys' channel order (``k_perm``: a permutation shared by queries and keys leaves the scores as they
        were), the weighted value sum put back in the model's channel order (``v_inv``)."""
        d, dv = qf.shape[-1], self.res_v.shape[-1]
        m, l, acc = native.module().kivi_decode(  # noqa: E741
            permute_channels(qf, self.k_perm), self.k_codes, self.k_scales, self.k_biases, self.v_codes,
            self.v_scales, self.v_biases, n, self.kbits, self.value_group(d), self.value_group(dv), dv, key_rows=True)
        return Partials(m, l, permute_channels(acc, self.v_inv))

    def _check_trim_rows(self, n: int) -> None:
        """Window rows only (sink rows too while nothing is quantized): not KIVI's rule, whole groups are refused
        as well."""
        if n > self.n_res and not (self.n_quant == 0 and n <= self.n_res + self.n_sink):
            raise ValueError(
                f"SKVQKVCache: trimming {n} tokens would reach quantized tokens (only the {self.n_res} "
                f"full-precision window tokens can be dropped exactly: a cache that never saw the trimmed "
                f"tokens would hold some of the remaining ones in its full-precision window)"
            )

    def _trim_rows(self, n: int) -> int:
        if n <= self.n_res:
            self.n_res -= n
            return n
        self.n_sink -= n - self.n_res  # nothing quantized (``_check_trim_rows``)
        self.n_res = 0
        return n

    def theoretical_bytes_per_token(self, d: int, dv: int) -> float:
        """Bytes per quantized token per KV head (codes + float16 scale/bias per channel group)."""
        return sum((x // self.value_group(x)) * (4 * gq.words_per_group(b, self.value_group(x)) + 4)
                   for x, b in ((d, self.kbits), (dv, self.vbits)))

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        held = (self.sink_k, self.sink_v, self.k_perm, self.k_inv, self.v_perm, self.v_inv, self.k_alpha, self.v_alpha)
        return B * H * self.n_quant * int(self.theoretical_bytes_per_token(D, dv)) + sum(
            a.nbytes for a in held if a is not None)
