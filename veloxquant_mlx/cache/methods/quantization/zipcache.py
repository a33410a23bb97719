"""ZipCache (He, Zhang, Wu, Liu, Zhou, Zhuang, NeurIPS 2024, arXiv 2405.14256): channel-separable tokenwise
quantization (key channels divided by sqrt(max |K[:, i]|), then a scale and zero point per token); saliency =
*normalized* attention (received attention / the number of queries that can see the token, undoing the causal
bias to early tokens); the most salient tokens at high bits, the rest at low bits.

New rows are held float16 as *pending* rows; ``attend`` (dispatch point) adds each real query's probability of
each pending row to ``sal_sum`` and the viewer count to ``sal_cnt``. At the next call the oldest whole multiples
of ``zipcache_group_size`` pending rows are compressed by saliency ``sal_sum / sal_cnt`` (key L2 norm without the
dispatch point; ``saliency_source`` says which): per KV head the ``zipcache_hi_fraction`` most salient at
``zipcache_hi_bits``, the rest at ``zipcache_lo_bits``, in a hi and a lo store routed by ``is_hi``; values alike
with ``zipcache_quantize_values``, else float16.

Deviations: saliency comes from all real queries that attended a token while it was pending (the paper: probe
queries at prefill, re-compression every 100 decode tokens) and a compressed token's width is fixed; top-f
selection per compressed block (the whole prompt is one block), per KV head; values follow the keys' routing;
trim is exact for pending rows only, deeper trims raise ``ValueError``; bits 1..8 (``groupquant``), dequantize +
matmul, except a CPU decode step with quantized values at 2, 4 or 8 bits: KIVI's CPU kernel reads the hi and lo
stores (keys as rows, ``_cpu_part``).
"""

from __future__ import annotations

import mlx.core as mx

from ... import kernels, native
from ...attention import bool_mask
from ...base import register
from ...contract import CompressedKVCache, register_with_mlx_lm
from ...primitives import blocks, groupquant as gq
from ...primitives.blocks import queued_row_blocks
from ...primitives.buffers import dtype_name, grow_rows
from ...window import Partials, join_partials
from .kivi import RES_DTYPE, KIVIKVCache

_ARR = ("codes", "scales", "biases")
SALIENCY_TILE = 64  # query rows per pass of a long first chunk (``_attend_scored``), at most
MIN_TILES = 32  # ... and at least this many passes


def _dense_part(kt, vv):
    """``_attend_codes``' ``part`` over dense rows of the compressed past: scores ``qf @ kt`` ([.., D, n] keys),
    values ``p @ vv``."""
    return lambda qf, n: (qf @ kt, lambda p: p @ vv)


@register_with_mlx_lm
@register("zipcache")
class ZipCacheKVCache(KIVIKVCache):
    """ZipCache: saliency-routed (normalized attention) per-token mixed precision."""
    chunk_invariant = False  # blocks follow the calls; saliency from the queries seen while pending
    exact_trim = False  # raises past the pending rows; the trimmed queries stay in the pending rows' saliency
    trim_exact_or_raises = False
    array_fields = tuple(f"{s}_{a}" for s in ("kh", "kl", "vh", "vl") for a in _ARR) + (
        "is_hi", "k_chan", "v_fp", "res_k", "res_v", "sal_sum", "sal_cnt")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "n_hi", "n_scored", "saliency_source")
    dequant_only = "two code widths routed per token"
    n_hi = 0  # compressed tokens at hi bits (per head)
    n_scored = 0  # pending rows (from the front) whose saliency has real-attention contributions
    saliency_source = "none"

    def _init_layout(self):
        o = self.config.options
        self.hi_bits, self.lo_bits, self.hi_fraction = o.hi_bits, o.lo_bits, float(o.hi_fraction)
        self.group, self.quantize_values = o.group_size, o.quantize_values
        self.qbits = self.lo_bits

    @property
    def n_lo(self) -> int:
        return self.n_quant - self.n_hi

    def _saliency(self, kb, f):
        if self.n_scored >= f:  # ``sal_*`` are [B, H, cap, 1], so that ``grow_rows`` applies
            self.saliency_source = "attention"
            return self.sal_sum[:, :, :f, 0] / mx.maximum(self.sal_cnt[:, :, :f, 0], 1.0)
        self.saliency_source = "key_norm"
        return mx.sqrt((kb.astype(mx.float32) ** 2).sum(-1))

    def _compress(self, f):
        """Compress the ``f`` oldest pending rows (f a multiple of G)."""
        kb, vb = self.res_k[:, :, :f], self.res_v[:, :, :f]
        sal = self._saliency(kb, f)  # [B, H, f]
        nh = round(self.hi_fraction * f)
        flag = mx.argsort(mx.argsort(-sal, axis=-1), axis=-1) < nh  # saliency rank < nh
        pos = mx.arange(f)[None, None]
        order = mx.argsort(mx.where(flag, pos, pos + f), axis=-1)  # hi rows, then lo rows, in position order
        if self.k_chan is None:  # channel-separable factors sqrt(max |K_i|), calibrated on the first block
            self.k_chan = mx.sqrt(mx.maximum(mx.abs(kb.astype(mx.float32)).max(axis=2, keepdims=True),
                                             1e-4)).astype(RES_DTYPE)
        ks = mx.take_along_axis(kb.astype(mx.float32) / self.k_chan.astype(mx.float32), order[..., None], axis=2)
        vs = mx.take_along_axis(vb, order[..., None], axis=2)
        h0, l0 = self.n_hi, self.n_lo
        stores = [("kh", ks[:, :, :nh], self.hi_bits, h0), ("kl", ks[:, :, nh:], self.lo_bits, l0)]
        if self.quantize_values:
            stores += [("vh", vs[:, :, :nh], self.hi_bits, h0), ("vl", vs[:, :, nh:], self.lo_bits, l0)]
        else:
            self.v_fp = grow_rows(self.v_fp, self.n_quant, vb)
        for name, x, bits, n0 in stores:
            if x.shape[2]:
                for a, arr in zip(_ARR, gq.quantize(x, bits, x.shape[-1])):  # tokenwise: one group per token
                    setattr(self, f"{name}_{a}", grow_rows(getattr(self, f"{name}_{a}"), n0, arr))
        self.is_hi = grow_rows(self.is_hi, self.n_quant, flag.astype(mx.uint8)[..., None])
        self.n_hi = h0 + nh
        self.n_quant += f

    def _store(self, keys, values):
        B, H, N, D = keys.shape
        self.dtype_name = dtype_name(keys.dtype)
        r = self.n_res
        f = (r // self.group) * self.group
        if f:
            self._compress(f)
            rem = r - f
            # the remaining pending rows (< G) go to fresh, small buffers: a prompt-sized pending buffer
            # must not outlive the prompt's compression
            for name in ("res_k", "res_v", "sal_sum", "sal_cnt"):
                setattr(self, name, grow_rows(None, 0, getattr(self, name)[:, :, f:r]) if rem else None)
            self.n_res = r = rem
            self.n_scored = max(self.n_scored - f, 0)
        past_k, past_v = (self.res_k[:, :, :r], self.res_v[:, :, :r]) if r else (None, None)
        self._call = (self.n_quant, r, past_k, past_v, keys, values)
        self.res_k = grow_rows(self.res_k, r, keys.astype(RES_DTYPE))
        self.res_v = grow_rows(self.res_v, r, values.astype(RES_DTYPE))
        zeros = mx.zeros((B, H, N, 1), dtype=mx.float32)
        self.sal_sum = grow_rows(self.sal_sum, r, zeros)
        self.sal_cnt = grow_rows(self.sal_cnt, r, zeros)
        self.n_res = r + N

    def _dequant_rows(self, pre, bits, n, dtype):
        if getattr(self, f"{pre}_codes") is None or n == 0:
            return None
        width = (self.res_k if pre[0] == "k" else self.res_v).shape[-1]
        return gq.dequantize(*(getattr(self, f"{pre}_{a}")[:, :, :n] for a in _ARR), bits, width, dtype)

    def _route(self, side, n, dtype):
        """Rows of the first ``n`` compressed tokens in position order from the hi / lo stores."""
        hi = self._dequant_rows(side + "h", self.hi_bits, self.n_hi, dtype)
        lo = self._dequant_rows(side + "l", self.lo_bits, self.n_lo, dtype)
        if hi is None or lo is None:
            return lo if hi is None else hi
        fi = self.is_hi[:, :, :n].astype(mx.int32)  # [B, H, n, 1]
        ih, il = (mx.maximum(mx.cumsum(f, axis=2) - 1, 0) for f in (fi, 1 - fi))
        return mx.where(fi > 0, mx.take_along_axis(hi, ih, axis=2), mx.take_along_axis(lo, il, axis=2))

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return (self._route("k", n, mx.float32) * self.k_chan.astype(mx.float32)).astype(dtype).swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        return self._route("v", n, dtype) if self.quantize_values else self.v_fp[:, :, :n].astype(dtype)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """KIVI's one softmax on the stored form (``_attend_codes``), then the saliency accumulators' update."""
        call = self._take_call(queries, keys)
        if call is None:
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        q0, r0, _, _, new_k, _ = call
        mask = self._own_mask(mask, queries, keys)
        past = self._returned_past(q0, keys, values)
        if q0 and past is None and queries.shape[2] == 1 and self._cpu_kernel_ready(
                mask, new_k.shape[-1], call[5].shape[-1], queries.shape[1] // new_k.shape[1]):
            out, contrib = kernels.checked_call(  # the CPU kernel, checked once against the op path
                "zipcache_cpu", self,
                lambda: self._attend_scored(queries, call, scale=scale, mask=mask, sinks=sinks, past=self._cpu_part),
                lambda: self._attend_scored(queries, call, scale=scale, mask=mask, sinks=sinks))
        else:
            out, contrib = self._attend_scored(queries, call, scale=scale, mask=mask, sinks=sinks, past=past)
        B, Hq, N, _ = queries.shape
        H, P = new_k.shape[1], r0 + N
        if isinstance(mask, str):  # [.., N, P] visibility of the full-precision columns
            visible = (mx.arange(P)[None] - r0) <= mx.arange(N)[:, None] if N > 1 else None
        else:
            visible = None if mask is None else bool_mask(mask, N, q0 + P, H)[..., q0:]
        cnt = mx.full((1, 1, P), float(Hq // H * N)) if visible is None else \
            mx.broadcast_to(visible.astype(mx.float32).sum(axis=-2, keepdims=True), (B, H, Hq // H, 1, P)).sum(
                axis=(2, 3))  # viewers per column, summed over the rows first: no [N, P] float32 copy
        self.sal_sum[:, :, :P] = self.sal_sum[:, :, :P] + contrib[..., None]
        self.sal_cnt[:, :, :P] = self.sal_cnt[:, :, :P] + mx.broadcast_to(cnt, contrib.shape)[..., None]
        self.n_scored = P
        # the sums are taken with the layer's attention: left to the state's evaluation they kept every layer's
        # [N, P] probabilities alive to the end of a prefill chunk (11x the plain cache's peak at 1023 tokens)
        return mx.depends(out, contrib)

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes KIVI's CPU kernel reads as rows: quantized values, both widths 2, 4 or 8 bits, head dims up to 256, up
        to 32 query heads a KV head."""
        return (native.available() and self.attend_path == "auto" and self.quantize_values
                and {self.hi_bits, self.lo_bits} <= {2, 4, 8} and max(d, dv) <= 256 and rep <= 32)

    def _cpu_layout(self) -> bool:
        return True  # ``_cpu_part``: the hi and the lo store, each a call of KIVI's CPU kernel with keys as rows

    def _cpu_part(self, qf, n: int):
        """The ``n`` compressed rows by KIVI's CPU kernel, keys read as rows (one group a token): the hi and the lo
        store a call each at its width, their partials joined (a softmax does not depend on the rows' order); the
        channel factors ``k_chan`` folded into the queries (q . (k_chan * x) = (q * k_chan) . x)."""
        qs, (d, dv) = qf * self.k_chan.astype(mx.float32), (qf.shape[-1], self.res_v.shape[-1])
        parts = [Partials(*native.module().kivi_decode(qs, *(getattr(self, f"{s}{t}_{a}") for s in "kv" for a in _ARR),
                                                       m, bits, d, dv, dv, key_rows=True))
                 for t, bits, m in (("h", self.hi_bits, self.n_hi), ("l", self.lo_bits, self.n_lo)) if m]
        return join_partials(parts)

    def _attends_returned_rows(self) -> bool:
        return False  # each step needs its pending rows' weights: its own attention, on the rows (``_returned_past``)

    def _returned_past(self, q0, keys, values):
        """On a GPU, the compressed past scored on the rows ``update_and_fetch`` returned (``part`` of
        ``_attend_codes``): they hold its decoding already, and decoding it again doubled a step's host time (the
        other variants' rule, ``GroupedQuantCache._attends_returned_rows``). ``None`` on the CPU, where those rows
        are never evaluated and attention reads the float32 decoding."""
        if not q0 or blocks.on_cpu():
            return None
        return _dense_part(keys[:, :, :q0].swapaxes(-1, -2), values[:, :, :q0])

    def _attend_scored(self, queries, call, *, scale, mask, sinks, past=None):
        """(output, probability mass [B, H, r0 + N] of the pending and the call's rows, summed over the queries).
        A long chunk with a causal mask goes in tiles of at most ``SALIENCY_TILE`` query rows and at least
        ``MIN_TILES`` tiles, queued one by one (``queued_row_blocks``) over the compressed past decoded once, so a
        few tiles' [rows, M] probabilities are alive at a time: in one pass ``joint_attention`` holds several
        [N, M] float32 arrays (SmolLM2, 1023 tokens in one chunk: 2.67x the plain cache's peak in one pass, 0.81x
        in tiles, the prefill 1.20x -> 0.64x its time; 2048 tokens in chunks of 1024, the second chunk in one pass:
        2.73x). ``past``: the compressed past's ``part`` (``_returned_past``), else decoded here."""
        N = queries.shape[2]
        if N <= SALIENCY_TILE or not isinstance(mask, str):
            out, mass = self._attend_codes(queries, call, scale=scale, mask=mask, sinks=sinks, weights=True,
                                           part=past)
            return out, mass[-1]
        q0, r0, past_k, past_v, new_k, new_v = call
        if past is None:  # the compressed past, decoded once
            past = _dense_part(self._keys_t(q0), self._values(q0)) if q0 else _dense_part(None, None)

        def tile(a, b):  # causal: rows a..b see the compressed past, the pending rows and the call's first b
            sub = (q0, r0, past_k, past_v, new_k[:, :, :b], new_v[:, :, :b])
            out, mass = self._attend_codes(queries[:, :, a:b], sub, scale=scale, mask=mask, sinks=sinks, weights=True,
                                           part=past)
            return out, mx.pad(mass[-1], [(0, 0), (0, 0), (0, N - b)])

        tiles = queued_row_blocks(tile, N, min(SALIENCY_TILE, -(-N // MIN_TILES)))
        return mx.concatenate([o for o, _ in tiles], axis=2), sum((m for _, m in tiles[1:]), tiles[0][1])

    def _check_trim_rows(self, n: int) -> None:
        """Pending rows only: the saliency of the trimmed rows chose the widths of the compressed ones."""
        if n > self.n_res:
            raise ValueError(
                f"ZipCacheKVCache: trimming {n} tokens would reach compressed tokens (only the {self.n_res} "
                "float16 pending rows can be dropped exactly: their saliency chose the widths of the others)")
        super()._check_trim_rows(n)

    def _trim_rows(self, n: int) -> int:
        self.n_scored = min(self.n_scored, self.n_res - n)
        return super()._trim_rows(n)

    def _used(self, *stores) -> int:
        """Bytes of the filled rows of the hi/lo stores ``stores`` (codes, scales, biases)."""
        return sum(self._rows_bytes(f"{p}_{x}", self.n_hi if p[1] == "h" else self.n_lo) for p in stores for x in _ARR)

    def _rows_bytes(self, name, n) -> int:
        a = getattr(self, name)
        return 0 if a is None else a[:, :, :n].nbytes

    @property
    def compressed_key_bytes(self) -> int:
        """Key-side bytes held: hi/lo key codes + scales/biases, channel factors, routing flags, pending rows."""
        extra = (0 if self.k_chan is None else self.k_chan.nbytes) + self._rows_bytes("is_hi", self.n_quant)
        return self._used("kh", "kl") + extra + self._rows_bytes("res_k", self.n_res)

    @property
    def compressed_value_bytes(self) -> int:
        q = self._used("vh", "vl") if self.quantize_values else self._rows_bytes("v_fp", self.n_quant)
        return q + self._rows_bytes("res_v", self.n_res)

    def _baseline(self, res) -> int:
        """Uniform lo-bit tokenwise codes for the compressed tokens (no routing) + the same pending rows."""
        if res is None:
            return 0
        B, H, _, d = res.shape
        return B * H * self.n_quant * (4 * gq.words_per_group(self.lo_bits, d) + 4) + res[:, :, : self.n_res].nbytes

    baseline_key_bytes = property(lambda self: self._baseline(self.res_k))
    baseline_value_bytes = property(lambda self: self._baseline(self.res_v))

    @property
    def compression_ratio(self) -> float:  # keys only
        c = self.compressed_key_bytes
        return self.fp16_key_bytes / c if c else 1.0

    @property
    def effective_avg_bits(self) -> float:
        """8 * bytes of the quantized key arrays (codes, scales, biases) per quantized key element."""
        if not self.n_quant:
            return 0.0
        B, H, _, D = self.res_k.shape
        return 8.0 * self._used("kh", "kl") / (B * H * self.n_quant * D)

    @property
    def used_nbytes(self) -> int:
        return self.compressed_key_bytes + self.compressed_value_bytes
