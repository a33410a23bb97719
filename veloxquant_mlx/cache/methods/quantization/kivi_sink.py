"""KIVI with attention sinks: KIVI (Liu et al., ICML 2024, arXiv 2402.02750) whose first S = ``n_sink_tokens``
tokens stay in a float16 sink buffer ahead of KIVI's groups. The first tokens draw a large share of attention
whatever their content (StreamingLLM, arXiv 2309.17453), so an error in their keys moves every softmax; IntactKV
(arXiv 2403.01241) and SKVQ (arXiv 2405.06219) keep them exact. Bytes: KIVI's plus 2*S*D*2 per KV head.

Deviations (besides KIVI's): attention dequantizes (``quantized_matmul`` over the codes would not cover the sinks
ahead of them), except a decode step once codes exist, which reads them in KIVI's decode kernels (CPU, CUDA) and
joins the sinks, the residual and the new row as exact rows in the same softmax; ``n_sink_tokens = 0`` is KIVI; trim
drops the residual, whole groups and then sink rows, and raises ``ValueError`` on a cut into a group.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives.buffers import dtype_name
from .kivi import RES_DTYPE, KIVIKVCache


class SinkRows:
    """Float16 sink rows ``sink_k``/``sink_v`` (the first ``n_sink_cap`` tokens) ahead of a grouped
    layout's quantized part (kivi_sink, skvq)."""

    n_sink = 0  # sink rows filled (<= n_sink_cap)

    def _take_sinks(self, keys, values) -> int:
        """Copy the call's first rows into the sinks while they have room; returns how many."""
        B, H, N, D = keys.shape
        s0, S = self.n_sink, self.n_sink_cap
        take = min(S - s0, N)
        if take > 0:
            if self.sink_k is None:
                self.sink_k = mx.zeros((B, H, S, D), dtype=RES_DTYPE)
                self.sink_v = mx.zeros((B, H, S, values.shape[-1]), dtype=RES_DTYPE)
            # copied: for a float16 model ``astype`` is a view of this call's rows, and an assignment that
            # fills the whole sink buffer hands back that view, which would keep the whole chunk alive
            self.sink_k[:, :, s0 : s0 + take] = mx.contiguous(keys[:, :, :take].astype(RES_DTYPE))
            self.sink_v[:, :, s0 : s0 + take] = mx.contiguous(values[:, :, :take].astype(RES_DTYPE))
            self.n_sink = s0 + take
        return take

    def _after_sinks(self, sink, n: int, rest, dtype) -> mx.array:
        """Rows [B, H, n, d] of the quantized part: the sink rows, then ``rest(m)`` for the other ``m``."""
        s = min(n, self.n_sink)
        parts = ([sink[:, :, :s].astype(dtype)] if s else []) + ([rest(n - s)] if n > s else [])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _lead_rows(self, q0: int):
        """The sink rows among a call's ``q0`` quantized-part rows (sinks first), as (count, (keys, values))."""
        s = min(q0, self.n_sink)
        return s, ((self.sink_k[:, :, :s], self.sink_v[:, :, :s]) if s else None)

    def _dense(self):
        r = self.n_res
        res = (self.res_k[:, :, :r], self.res_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_sink + self.n_quant, *res, dtype=getattr(mx, self.dtype_name))

    def stored_rows(self) -> int:
        return self.n_sink + self.n_quant + self.n_res


@register_with_mlx_lm
@register("kivi_sink")
class KIVISinkKVCache(SinkRows, KIVIKVCache):
    """KIVI whose first ``n_sink_tokens`` tokens stay float16 (attention sinks)."""
    chunk_invariant = True  # sinks are the first positions, then KIVI's position-aligned groups
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a quantized group
    array_fields = KIVIKVCache.array_fields + ("sink_k", "sink_v")
    scalar_fields = KIVIKVCache.scalar_fields + ("n_sink",)
    dequant_only = "sink rows precede the codes"
    own_codes_after_lead_rows = True  # a decode step: KIVI's kernels on the codes, the sinks as exact rows

    def _init_layout(self):
        super()._init_layout()
        self.n_sink_cap = self.config.options.n_sink_tokens

    def _store(self, keys, values):
        B, H, N, D = keys.shape
        if self.res_k is None:  # allocated here (not lazily as in KIVI) so that they always exist
            self.res_k = mx.zeros((B, H, self.group, D), dtype=RES_DTYPE)
            self.res_v = mx.zeros((B, H, self.group, values.shape[-1]), dtype=RES_DTYPE)
        q0 = self.n_sink + self.n_quant  # the "quantized part" before this call: sinks, then groups
        take = self._take_sinks(keys, values)
        if take < N:
            super()._store(keys[:, :, take:], values[:, :, take:])
            _, r0, past_k, past_v, _, _ = self._call
        else:
            self.dtype_name = dtype_name(keys.dtype)
            r0, past_k, past_v = 0, None, None  # no residual while the sinks are filling
        self._call = (q0, r0, past_k, past_v, keys, values)

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        keys_t = super()._keys_t
        return self._after_sinks(self.sink_k, n, lambda m: keys_t(m, dtype).swapaxes(-1, -2), dtype).swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        values = super()._values
        return self._after_sinks(self.sink_v, n, lambda m: values(m, dtype), dtype)

    def _check_trim_rows(self, n: int) -> None:
        """KIVI's rule while the trim stays within the groups; past them it drops them all, then sink rows."""
        if n <= self.n_res + self.n_quant:
            super()._check_trim_rows(n)

    def _trim_rows(self, n: int) -> int:  # n <= the offset, which is stored_rows()
        beyond = n - self.n_res - self.n_quant  # sink rows to drop, if > 0
        if beyond <= 0:
            return super()._trim_rows(n)
        self.n_res = self.n_quant = 0
        self.n_sink -= beyond
        return n

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        return super()._code_nbytes(B, H, D, dv) + sum(a.nbytes for a in (self.sink_k, self.sink_v) if a is not None)
