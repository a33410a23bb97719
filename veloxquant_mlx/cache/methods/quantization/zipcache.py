"""ZipCache (He, Zhang, Wu, Liu, Zhou, Zhuang, "ZipCache: Accurate and Efficient KV Cache Quantization with
Salient Token Identification", NeurIPS 2024, arXiv 2405.14256).

Paper: (1) *channel-separable tokenwise quantization*: key channels are divided by a per-channel factor
c_i = sqrt(max |K[:, i]|) (taming channel outliers), then every token is quantized with one scale and
zero point over all its channels (few quantization parameters); values are quantized tokenwise;
(2) *normalized attention score* as the saliency of a token: the attention it receives summed over
queries, divided by the number of queries that can see it (undoing the causal mask's bias towards
early tokens); (3) mixed precision: the most salient tokens at high bits, the rest at low bits.

This implementation (``zipcache_hi_bits`` = bh, ``zipcache_lo_bits`` = bl, ``zipcache_hi_fraction`` =
f, ``zipcache_group_size`` = G):

* New rows are attended in full precision and held float16 as *pending* rows; ``attend`` (the
  dispatch point, with the model's real queries) adds every query's softmax probability of every
  pending row to ``sal_sum`` and the number of queries (x query heads per KV head) that could see the
  row to ``sal_cnt``. At the next call, the oldest complete multiples of G pending rows are compressed
  (so a prompt is compressed as one block after its own prefill attention, decode rows G at a time),
  with saliency ``sal_sum / sal_cnt``.
* Fallback (no dispatch point installed, so no queries reach the cache): saliency = key L2 norm (what
  the system this replaces used); ``saliency_source`` says which one compressed the last block.
* In each compressed block of n rows, per KV head, the round(f*n) most salient rows are *hi* tokens
  (stored at bh bits), the rest *lo* (bl bits). Keys: divided by the per-head channel factors
  ``k_chan`` [B, H, 1, D] (calibrated on the first block, float16), tokenwise group-affine codes (one
  group = the whole head dim) in a hi store (``kh_*``) and a lo store (``kl_*``), each in position
  order; ``is_hi`` (uint8 [B, H, T]) routes token t to its store (its index there = the count of
  hi/lo flags before it). Values: the same routing and widths (``vh_*``/``vl_*``) when
  ``zipcache_quantize_values``, else float16 (``v_fp``).
* Attention (dispatch point): scores over [dequantized compressed part, float16 pending rows + this
  call's rows], one softmax, as KIVI does; equal to dense attention over what ``update_and_fetch``
  returned. Without the dispatch point mlx_lm attends over those dense rows.
* Bytes per token per KV head (compressed part): keys ``(f*bh + (1-f)*bl)*D/8 + 4`` (+1 flag byte),
  values the same (no flag) or ``2*Dv`` (float16).
* Spec properties (from the stored arrays): ``compressed_key_bytes`` / ``compressed_value_bytes``
  (codes, scales, biases of both stores, the channel factors and the routing flags on the key side,
  and the pending float16 rows), ``baseline_*_bytes`` (uniform bl-bit tokenwise codes for the
  compressed tokens + the same pending rows), ``fp16_*_bytes``, ``compression_ratio`` (key side,
  fp16 / compressed) and ``effective_avg_bits`` (8 * bytes of the quantized key arrays per key element).

Deviations:

* Saliency from all real queries that attended a token while it was pending (the paper: probe queries
  at prefill, then re-compression every 100 decode tokens); once compressed, a token's width is
  fixed (no re-compression).
* Top-f selection per compressed block (the whole prompt is one block), per KV head.
* Values follow the keys' saliency routing (the paper quantizes values with the same mixed
  precision); the system this replaces kept values uniformly at hi bits.
* Trim is exact for pending rows only; deeper trims raise ``ValueError``.
* Bits 1..8 (``groupquant``); the dequantize + matmul path on every backend.

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 511 essay tokens prefilled + 32
scored decode steps, mean next-token KL vs mlx_lm's plain cache; kv_bytes = bytes held / fp16 cache):
defaults (20% at 4 bits, 80% at 2, values routed the same way): KL 0.180 (top-1 0.69), kv_bytes 0.252.
"""

from __future__ import annotations

import mlx.core as mx

from ...attention import bool_mask
from ...base import register
from ...contract import CompressedKVCache, register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import grow_rows
from ...primitives import groupquant as gq
from .kivi import RES_DTYPE, KIVIKVCache

_ARR = ("codes", "scales", "biases")


def _int(field, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise QuantizerConfigError(field, v, f"an int >= {lo}" + (f" and <= {hi}" if hi else "")
                                   + " for method='zipcache'")
    return int(v)


@register_with_mlx_lm
@register("zipcache")
class ZipCacheKVCache(KIVIKVCache):
    """ZipCache: saliency-routed (normalized attention) per-token mixed precision."""
    # blocks follow the calls (the prompt is one block); saliency from the queries seen while
    # pending; channel factors from the first block
    chunk_invariant = False
    # raises ValueError once the trimmed rows reach compressed ones; the trimmed queries stay in the
    # pending rows' saliency
    exact_trim = False
    trim_exact_or_raises = False

    array_fields = tuple(f"{s}_{a}" for s in ("kh", "kl", "vh", "vl") for a in _ARR) + (
        "is_hi", "k_chan", "v_fp", "res_k", "res_v", "sal_sum", "sal_cnt")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "n_hi", "n_scored", "saliency_source")

    n_hi = 0  # compressed tokens at hi bits (per head)
    n_scored = 0  # pending rows (from the front) whose saliency has real-attention contributions
    saliency_source = "none"

    def _init_layout(self):
        o = self.config.options
        self.hi_bits = _int("zipcache_hi_bits", o.hi_bits, 1, 8)
        self.lo_bits = _int("zipcache_lo_bits", o.lo_bits, 1, 8)
        if self.hi_bits < self.lo_bits:
            raise QuantizerConfigError("zipcache_hi_bits", o.hi_bits, f"an int >= zipcache_lo_bits={o.lo_bits}")
        f = o.hi_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise QuantizerConfigError("zipcache_hi_fraction", f, "a number in [0, 1]")
        self.hi_fraction = float(f)
        self.group = _int("zipcache_group_size", o.group_size, 1)
        self.quantize_values = bool(o.quantize_values)
        self.qbits = self.lo_bits
        self._call = None

    dequant_only = "two code widths routed per token"

    @property
    def n_lo(self) -> int:
        return self.n_quant - self.n_hi

    # ---------------------------------------------------------------- compression
    def _saliency(self, kb, f):
        if self.n_scored >= f:
            self.saliency_source = "attention"
            return self._saliency_view("sal_sum", f) / mx.maximum(self._saliency_view("sal_cnt", f), 1.0)
        self.saliency_source = "key_norm"
        return mx.sqrt((kb.astype(mx.float32) ** 2).sum(-1))

    def _compress(self, f):
        """Compress the ``f`` oldest pending rows (f a multiple of G)."""
        kb, vb = self.res_k[:, :, :f], self.res_v[:, :, :f]
        B, H, _, D = kb.shape
        sal = self._saliency(kb, f)  # [B, H, f]
        nh = round(self.hi_fraction * f)
        rank = mx.argsort(mx.argsort(-sal, axis=-1), axis=-1)  # 0 = most salient
        flag = rank < nh  # [B, H, f]
        pos = mx.arange(f)[None, None]
        order = mx.argsort(mx.where(flag, pos, pos + f), axis=-1)  # hi rows, then lo rows, in position order
        if self.k_chan is None:  # channel-separable factors sqrt(max |K_i|), calibrated on the first block
            self.k_chan = mx.sqrt(mx.maximum(mx.abs(kb.astype(mx.float32)).max(axis=2, keepdims=True),
                                             1e-4)).astype(RES_DTYPE)
        kn = kb.astype(mx.float32) / self.k_chan.astype(mx.float32)
        ks = mx.take_along_axis(kn, order[..., None], axis=2)
        vs = mx.take_along_axis(vb, order[..., None], axis=2)
        h0, l0 = self.n_hi, self.n_lo
        stores = [("kh", ks[:, :, :nh], self.hi_bits, h0), ("kl", ks[:, :, nh:], self.lo_bits, l0)]
        if self.quantize_values:
            stores += [("vh", vs[:, :, :nh], self.hi_bits, h0), ("vl", vs[:, :, nh:], self.lo_bits, l0)]
        else:
            self.v_fp = grow_rows(self.v_fp, self.n_quant, vb)
        for name, x, bits, n0 in stores:
            if x.shape[2] == 0:
                continue
            q = gq.quantize(x, bits, x.shape[-1])  # tokenwise: one group per token
            for a, arr in zip(_ARR, q):
                setattr(self, f"{name}_{a}", grow_rows(getattr(self, f"{name}_{a}"), n0, arr))
        self.is_hi = grow_rows(self.is_hi, self.n_quant, flag.astype(mx.uint8)[..., None])
        self.n_hi = h0 + nh
        self.n_quant += f

    def _store(self, keys, values):
        B, H, N, D = keys.shape
        self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
        G, r = self.group, self.n_res
        f = (r // G) * G
        if f:
            self._compress(f)
            rem = r - f
            # the remaining pending rows (< G) go to fresh, small buffers: a prompt-sized pending buffer
            # must not outlive the prompt's compression
            for name in ("res_k", "res_v", "sal_sum", "sal_cnt"):
                a = getattr(self, name)
                setattr(self, name, grow_rows(None, 0, a[:, :, f:r]) if rem else None)
            self.n_res = r = rem
            self.n_scored = max(self.n_scored - f, 0)
        past_k = self.res_k[:, :, :r] if r else None
        past_v = self.res_v[:, :, :r] if r else None
        self._call = (self.n_quant, r, past_k, past_v, keys, values)
        self.res_k = grow_rows(self.res_k, r, keys.astype(RES_DTYPE))
        self.res_v = grow_rows(self.res_v, r, values.astype(RES_DTYPE))
        zeros = mx.zeros((B, H, N, 1), dtype=mx.float32)
        self.sal_sum = grow_rows(self.sal_sum, r, zeros)
        self.sal_cnt = grow_rows(self.sal_cnt, r, zeros)
        self.n_res = r + N

    # sal_* are stored [B, H, cap, 1] so that eviction.grow_rows's axis-2 growth applies; views [B, H, n]
    def _saliency_view(self, name, n):
        return getattr(self, name)[:, :, :n, 0]

    # ---------------------------------------------------------------- decoding
    def _dequant_rows(self, pre, bits, n, dtype):
        codes = getattr(self, f"{pre}_codes")
        if codes is None or n == 0:
            return None
        return gq.dequantize(codes[:, :, :n], getattr(self, f"{pre}_scales")[:, :, :n],
                             getattr(self, f"{pre}_biases")[:, :, :n], bits, self._width(pre), dtype)

    def _width(self, pre):
        return (self.res_k if pre[0] == "k" else self.res_v).shape[-1]

    def _route(self, hi, lo, n):
        """Rows of the first ``n`` compressed tokens in position order from the hi / lo stores."""
        flag = self.is_hi[:, :, :n]  # [B, H, n, 1]
        if hi is None:
            return lo
        if lo is None:
            return hi
        fi = flag.astype(mx.int32)
        ih = mx.maximum(mx.cumsum(fi, axis=2) - 1, 0)
        il = mx.maximum(mx.cumsum(1 - fi, axis=2) - 1, 0)
        return mx.where(flag > 0, mx.take_along_axis(hi, ih, axis=2), mx.take_along_axis(lo, il, axis=2))

    def _keys_rows(self, n, dtype=mx.float32):
        k = self._route(self._dequant_rows("kh", self.hi_bits, self.n_hi, mx.float32),
                        self._dequant_rows("kl", self.lo_bits, self.n_lo, mx.float32), n)
        return (k * self.k_chan.astype(mx.float32)).astype(dtype)

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        return self._keys_rows(n, dtype).swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        if not self.quantize_values:
            return self.v_fp[:, :, :n].astype(dtype)
        return self._route(self._dequant_rows("vh", self.hi_bits, self.n_hi, dtype),
                           self._dequant_rows("vl", self.lo_bits, self.n_lo, dtype), n)

    # ---------------------------------------------------------------- attention + saliency
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """KIVI's one softmax on the stored form for every call (``_attend_codes``), which also adds
        each query's softmax probability of every pending row (and how many queries saw it) to the
        saliency accumulators."""
        call = self._take_call(queries, keys)
        if call is None:
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        q0, r0, _, _, new_k, _ = call
        mask = self._own_mask(mask, queries, keys)
        out, probs = self._attend_codes(queries, call, scale=scale, mask=mask, sinks=sinks, weights=True)
        B, Hq, N, _ = queries.shape
        H, P = new_k.shape[1], r0 + N
        p_f = probs[-1]  # [B, H, rep, N, P]: the pending rows, then the call's own
        if isinstance(mask, str):  # [.., N, P] visibility of the full-precision columns
            visible = (mx.arange(P)[None] - r0) <= mx.arange(N)[:, None] if N > 1 else None
        else:
            visible = None if mask is None else bool_mask(mask, N, q0 + P, H)[..., q0:]
        # normalized attention saliency of the pending rows: probability mass / number of viewers
        contrib = p_f.sum(axis=(2, 3))  # [B, H, P]
        if visible is None:
            cnt = mx.full((1, 1, P), float(Hq // H * N))
        else:
            cnt = mx.broadcast_to(visible, p_f.shape).astype(mx.float32).sum(axis=(2, 3))
        self.sal_sum[:, :, :P] = self.sal_sum[:, :, :P] + contrib[..., None]
        self.sal_cnt[:, :, :P] = self.sal_cnt[:, :, :P] + mx.broadcast_to(cnt, contrib.shape)[..., None]
        self.n_scored = P
        return out

    # ---------------------------------------------------------------- trim
    def _trim_rows(self, n: int) -> int:
        self._call = None
        if n <= self.n_res:
            self.n_res -= n
            self.n_scored = min(self.n_scored, self.n_res)
            return n
        raise ValueError(
            f"ZipCacheKVCache: trimming {n} tokens would reach compressed tokens (only the {self.n_res} "
            "float16 pending rows can be dropped exactly: their saliency chose the widths of the others)"
        )

    # ---------------------------------------------------------------- accounting
    def _used(self, pre, n):
        a = [getattr(self, f"{pre}_{x}") for x in _ARR]
        return 0 if a[0] is None else sum(x[:, :, :n].nbytes for x in a)

    def _quantized_key_bytes(self) -> int:
        return self._used("kh", self.n_hi) + self._used("kl", self.n_lo)

    def _pending_bytes(self, name) -> int:
        a = getattr(self, name)
        return 0 if a is None else a[:, :, : self.n_res].nbytes

    @property
    def compressed_key_bytes(self) -> int:
        """Key-side bytes held: hi/lo key codes + scales/biases, channel factors, routing flags, pending rows."""
        extra = sum(a.nbytes for a in (self.k_chan,) if a is not None)
        flags = 0 if self.is_hi is None else self.is_hi[:, :, : self.n_quant].nbytes
        return self._quantized_key_bytes() + extra + flags + self._pending_bytes("res_k")

    @property
    def compressed_value_bytes(self) -> int:
        if self.quantize_values:
            q = self._used("vh", self.n_hi) + self._used("vl", self.n_lo)
        else:
            q = 0 if self.v_fp is None else self.v_fp[:, :, : self.n_quant].nbytes
        return q + self._pending_bytes("res_v")

    def _uniform_lo(self, d) -> int:
        if self.res_k is None:
            return 0
        B, H = self.res_k.shape[:2]
        return B * H * self.n_quant * (4 * gq.words_per_group(self.lo_bits, d) + 4)

    @property
    def baseline_key_bytes(self) -> int:
        """Uniform lo-bit tokenwise keys for the compressed tokens (no routing) + the same pending rows."""
        return 0 if self.res_k is None else self._uniform_lo(self.res_k.shape[-1]) + self._pending_bytes("res_k")

    @property
    def baseline_value_bytes(self) -> int:
        return 0 if self.res_v is None else self._uniform_lo(self.res_v.shape[-1]) + self._pending_bytes("res_v")

    @property
    def compression_ratio(self) -> float:
        """fp16 key bytes / compressed key bytes (> 1 = savings)."""
        c = self.compressed_key_bytes
        return self.fp16_key_bytes / c if c else 1.0

    @property
    def effective_avg_bits(self) -> float:
        """8 * bytes of the quantized key arrays (codes, scales, biases) per quantized key element."""
        if not self.n_quant:
            return 0.0
        B, H, _, D = self.res_k.shape
        return 8.0 * self._quantized_key_bytes() / (B * H * self.n_quant * D)

    @property
    def used_nbytes(self) -> int:
        return self.compressed_key_bytes + self.compressed_value_bytes
