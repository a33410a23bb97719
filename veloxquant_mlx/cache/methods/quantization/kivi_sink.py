"""KIVI with attention sinks: KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", ICML 2024, arXiv 2402.02750) whose first ``n_sink_tokens`` tokens are never quantized.

Why: "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., arXiv 2309.17453) shows
that the first few tokens receive a large share of the attention mass whatever their content; an
error in their keys moves every query's softmax. Several KV-quantization papers (e.g. IntactKV,
arXiv 2403.01241; SKVQ, arXiv 2405.06219) therefore keep these "pivot"/sink tokens in full precision.

Algorithm: the first ``n_sink_tokens`` = S tokens a cache sees go to a float16 sink buffer (stored
bit-exactly as float16: the residual's precision); every later token follows KIVI exactly (keys per
channel and values per token in ``bit_width_inlier``-bit groups of ``kivi_group_size`` = G tokens,
float16 residual of < G tokens). KIVI's groups start at position S. Attention (dispatch point) is
KIVI's: the "quantized part" of its one-softmax attention is [sink rows (float16, exact); dequantized
groups], the full-precision part the residual + this call's rows.

Bytes per token per KV head: KIVI's (b*D/8 + 4*D/G for K and for V, plus the G-row residual) plus a
constant 2*S*D*2 bytes for the sinks.

Deviations (besides KIVI's own, see ``kivi.py``):

* Attention on the codes uses the dequantize + matmul path on every backend (``_uses_qmm`` is
  False): the sink rows precede the codes in the quantized part, which ``mx.quantized_matmul`` over
  the code buffer alone would not cover.
* ``n_sink_tokens = 0`` is plain KIVI.
* Trim is exact: the residual, whole groups, and (once every group is gone) sink rows can be
  dropped; a cut into a quantized group raises ``ValueError`` as in KIVI.

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 511 essay tokens prefilled + 32
scored decode steps, mean next-token KL vs mlx_lm's plain cache; kv_bytes = bytes held / fp16 cache):
2 bits, G = 32, S = 5: KL 0.081 (top-1 0.84), kv_bytes 0.250; plain KIVI 2 bits: 0.206 (0.78), 0.241.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from .kivi import RES_DTYPE, KIVIKVCache


@register_with_mlx_lm
@register("kivi_sink")
class KIVISinkKVCache(KIVIKVCache):
    """KIVI whose first ``n_sink_tokens`` tokens stay float16 (attention sinks)."""
    chunk_invariant = True  # sinks are the first positions, then KIVI's position-aligned groups
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a quantized group

    array_fields = KIVIKVCache.array_fields + ("sink_k", "sink_v")
    scalar_fields = KIVIKVCache.scalar_fields + ("n_sink",)

    n_sink = 0  # sink rows filled (<= n_sink_cap)

    def _init_layout(self):
        super()._init_layout()
        s = self.config.options.n_sink_tokens
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise QuantizerConfigError("n_sink_tokens", s, "an int >= 0 for method='kivi_sink'")
        self.n_sink_cap = int(s)

    dequant_only = "sink rows precede the codes"

    # ---------------------------------------------------------------- storage
    def _store(self, keys, values):
        B, H, N, D = keys.shape
        s0, S = self.n_sink, self.n_sink_cap
        take = min(S - s0, N)
        if self.res_k is None:  # KIVI allocates these lazily; allocate here so they always exist
            self.res_k = mx.zeros((B, H, self.group, D), dtype=RES_DTYPE)
            self.res_v = mx.zeros((B, H, self.group, values.shape[-1]), dtype=RES_DTYPE)
        if take > 0:
            if self.sink_k is None:
                self.sink_k = mx.zeros((B, H, S, D), dtype=RES_DTYPE)
                self.sink_v = mx.zeros((B, H, S, values.shape[-1]), dtype=RES_DTYPE)
            # copied (mx.contiguous): for a float16 model ``astype`` is a view of this call's rows, and
            # an assignment that fills the whole sink buffer hands back that view, which would keep the
            # whole chunk alive
            self.sink_k[:, :, s0 : s0 + take] = mx.contiguous(keys[:, :, :take].astype(RES_DTYPE))
            self.sink_v[:, :, s0 : s0 + take] = mx.contiguous(values[:, :, :take].astype(RES_DTYPE))
            self.n_sink = s0 + take
        q0 = s0 + self.n_quant  # the "quantized part" before this call: sinks, then groups
        if take < N:
            super()._store(keys[:, :, take:], values[:, :, take:])
            _, r0, past_k, past_v, _, _ = self._call
        else:
            self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
            r0, past_k, past_v = 0, None, None  # no residual while the sinks are filling
        self._call = (q0, r0, past_k, past_v, keys, values)

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        """K^T [B, H, D, n] of the first ``n`` tokens of the quantized part (sinks, then groups)."""
        s = min(n, self.n_sink)
        parts = []
        if s:
            parts.append(self.sink_k[:, :, :s].astype(dtype).swapaxes(-1, -2))
        if n > s:
            parts.append(super()._keys_t(n - s, dtype))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        s = min(n, self.n_sink)
        parts = []
        if s:
            parts.append(self.sink_v[:, :, :s].astype(dtype))
        if n > s:
            parts.append(super()._values(n - s, dtype))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _dense(self):
        dtype = getattr(mx, self.dtype_name)
        r = self.n_res
        res = (self.res_k[:, :, :r], self.res_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_sink + self.n_quant, *res, dtype=dtype)

    def stored_rows(self) -> int:
        return self.n_sink + self.n_quant + self.n_res

    # ---------------------------------------------------------------- trim
    def _trim_rows(self, n: int) -> int:
        if n > self.stored_rows():
            raise ValueError(f"cannot trim {n} tokens: only {self.stored_rows()} are stored")
        beyond = n - self.n_res - self.n_quant  # sink rows to drop, if > 0
        if beyond <= 0:
            return super()._trim_rows(n)
        self._call = None
        self.n_res = self.n_quant = 0
        self.n_sink -= beyond
        return n

    # ---------------------------------------------------------------- accounting
    @property
    def used_nbytes(self) -> int:
        sink = 0 if self.sink_k is None else self.sink_k.nbytes + self.sink_v.nbytes
        return super().used_nbytes + sink

    @property
    def full_seq_bytes(self) -> int:
        ref = self.res_k if self.res_k is not None else self.sink_k
        if ref is None:
            return 0
        B, H, _, D = ref.shape
        dv = (self.res_v if self.res_v is not None else self.sink_v).shape[-1]
        return B * H * self.offset * (D + dv) * 2
