"""SKVQ (Duanmu et al., "SKVQ: Sliding-window Key and Value Cache Quantization for Large Language
Models", arXiv 2405.06219).

Paper: (1) *channel reordering*: channels with similar value ranges are put in the same quantization
group (calibrated once, offline); (2) *clipped dynamic quantization*: each group is quantized per token
(dynamically) over a range shrunk by a clip ratio alpha found by a search that minimises the
quantization error; (3) a *sliding window* of the most recent tokens stays in full precision, and a
few important tokens (attention sinks, the first tokens) are never quantized.

This implementation (a ``KIVIKVCache`` subclass reusing its one-softmax attention over [quantized
part, full-precision part], see ``kivi.py``):

* sinks: the first ``skvq_n_sink`` = S tokens in float16 (``sink_k``/``sink_v``, bit-exact float16);
* window: the newest tokens in a float16 buffer of at most ``skvq_window`` + g rows (``res_k``/``res_v``,
  grown as it fills);
  when it holds W + g tokens (W = ``skvq_window``, g the group width below), all but the newest W
  are quantized and leave it, so the newest W..W+g-1 tokens are always exact;
* quantized middle, per token: keys at ``skvq_bits_key`` bits, values at ``skvq_bits_value``, channel
  groups of g = gcd(D, ``skvq_group_size``) consecutive channels *after* a per-head permutation
  (``k_perm``/``v_perm`` [H, D], inverse ``k_inv``/``v_inv``), each group clipped to its range shrunk
  by alpha about its centre (``k_alpha``/``v_alpha`` [H, D/g]) and then min/max affine-quantized
  (``groupquant``: uint32 codes, float16 scale and bias per group);
* calibration, on the first block that is quantized (the prompt, in practice): the permutation sorts
  channels by their range over the block; alpha is searched per head and group among
  ``skvq_clip_alpha`` * (1, 0.95, ..., 0.5) (``skvq_clip_search``; otherwise alpha =
  ``skvq_clip_alpha`` everywhere) minimising the block's squared reconstruction error.
* Bytes per token per KV head in the quantized part: ``bk*D/8 + 4*D/g`` (keys) + ``bv*Dv/8 + 4*Dv/g``
  (values); plus constants: 2*S*D*2 sink bytes, the window (at most W+g rows), the permutations and alphas.

Deviations from the paper:

* Reordering sorts channels by range and cuts equal groups (the paper clusters channel ranges, with
  groups of a fixed size after reordering: the same intent; the sort is the 1-D optimum for equal
  groups of similar range).
* Calibration is online on the first quantized block of each layer's own cache, not offline on a
  calibration dataset; alpha is searched per head and channel group (the paper: per layer/group).
* ``skvq_max_ctx`` is accepted and unused (buffers grow on demand).
* The window is flushed g tokens at a time (W..W+g-1 exact tokens, the paper exactly W).
* Window tokens leave it after the step's attention (the step sees them in full precision).
* Attention dequantizes and multiplies (``_uses_qmm`` False: permuted channels).
* Trim drops window rows only; deeper trims raise ``ValueError`` (a cache that never saw the
  trimmed tokens would hold some quantized tokens in its window). Even a window-only trim is not
  exact when the trimmed tokens pushed older ones out of the window: those stay quantized
  (``exact_trim = False``).

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 511 essay tokens prefilled + 32
scored decode steps, mean next-token KL vs mlx_lm's plain cache; kv_bytes = bytes held / fp16 cache):
K2 V2, G = 32, S = 5: W = 128 KL 0.183 (kv_bytes 0.458); W = 32 KL 0.243 (0.319), and 0.321 without
reordering and clipping (same bytes): reordering + clip search remove a quarter of the KL.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import MIN_GROW, grow_rows
from ...primitives import groupquant as gq
from ...primitives import mixedquant as mq
from .kivi import RES_DTYPE, KIVIKVCache

CLIP_GRID = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5


@register_with_mlx_lm
@register("skvq")
class SKVQKVCache(KIVIKVCache):
    """SKVQ: reordered, clipped per-token group quantization; float16 sinks and sliding window."""
    # channel order and clip ratios calibrated on the first quantized block; the float16 window is
    # cut to W rows by a prefill call but holds W..W+g-1 between decode flushes
    chunk_invariant = False
    exact_trim = False  # returns n, but rows the trimmed rows pushed out of the window stay quantized
    trim_exact_or_raises = False

    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "res_k", "res_v",
                    "sink_k", "sink_v", "k_perm", "k_inv", "v_perm", "v_inv", "k_alpha", "v_alpha")
    scalar_fields = KIVIKVCache.scalar_fields + ("n_sink",)

    n_sink = 0

    def _init_layout(self):
        o = self.config.options  # validation checked the widths (1..8), the group, window and sinks
        if not 0.0 < o.clip_alpha <= 1.0:
            raise QuantizerConfigError("skvq_clip_alpha", o.clip_alpha, "a number in (0, 1] for method='skvq'")
        self.kbits, self.vbits, self.group = o.bits_key, o.bits_value, o.group_size
        self.window, self.n_sink_cap = o.window, o.n_sink
        self.alpha, self.reorder, self.clip_search = float(o.clip_alpha), o.reorder, o.clip_search
        self.qbits = self.kbits
        self._call = None

    def cgroup(self, d: int) -> int:
        """Channel-group width for head dim ``d``."""
        return math.gcd(d, self.group)

    dequant_only = "permuted, clipped channels"

    # ---------------------------------------------------------------- quantization
    def _calibrate(self, x: mx.array, bits: int):
        B, H, T, D = x.shape
        g = self.cgroup(D)
        if self.reorder:
            perm, inv = mq.range_permutation(x)
        else:
            perm = inv = mx.broadcast_to(mx.arange(D, dtype=mx.int32)[None], (H, D))
        xp = mq.permute_channels(x, perm)
        if self.clip_search:
            alpha = mq.search_clip(xp, bits, g, [self.alpha * r for r in CLIP_GRID])
        else:
            alpha = mx.full((H, D // g), self.alpha, dtype=mx.float32)
        return perm, inv, alpha

    def _encode(self, x, bits, perm, alpha):
        g = self.cgroup(x.shape[-1])
        xc = mq.clip_to_alpha(mq.permute_channels(x, perm), g, alpha)
        return gq.quantize(xc, bits, g)

    def _decode(self, codes, scales, biases, bits, inv, dtype):
        g = self.cgroup(inv.shape[-1])
        return mq.permute_channels(gq.dequantize(codes, scales, biases, bits, g, dtype), inv)

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

    # ---------------------------------------------------------------- storage
    def _store(self, keys, values):
        B, H, N, D = keys.shape
        dv = values.shape[-1]
        self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
        cap = self.window + self.cgroup(D)
        s0, S = self.n_sink, self.n_sink_cap
        take = min(S - s0, N)
        self._reserve_window(min(cap, max(1, self.n_res + N - max(take, 0))), cap, B, H, D, dv)
        if take > 0:
            if self.sink_k is None:
                self.sink_k = mx.zeros((B, H, S, D), dtype=RES_DTYPE)
                self.sink_v = mx.zeros((B, H, S, dv), dtype=RES_DTYPE)
            # copied: a same-dtype astype is a view of the chunk (see kivi_sink.py)
            self.sink_k[:, :, s0 : s0 + take] = mx.contiguous(keys[:, :, :take].astype(RES_DTYPE))
            self.sink_v[:, :, s0 : s0 + take] = mx.contiguous(values[:, :, :take].astype(RES_DTYPE))
            self.n_sink = s0 + take
        q0, r0 = s0 + self.n_quant, self.n_res
        past_k = self.res_k[:, :, :r0] if r0 else None
        past_v = self.res_v[:, :, :r0] if r0 else None
        self._call = (q0, r0, past_k, past_v, keys, values)
        n = N - max(take, 0)
        if n == 0:
            return
        k16 = keys[:, :, N - n :].astype(RES_DTYPE)
        v16 = values[:, :, N - n :].astype(RES_DTYPE)
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
        """Room for ``need`` <= ``cap`` (W + g) window rows: the buffers grow as ``grow_rows`` does (by
        max(16, 1/8) spare rows) up to ``cap``, so a short chat holds its own rows, not the window up front."""
        have = 0 if self.res_k is None else self.res_k.shape[2]
        if need <= have:
            return
        rows = min(cap, need + max(MIN_GROW, need // 8))
        k = mx.zeros((B, H, rows, D), dtype=RES_DTYPE)
        v = mx.zeros((B, H, rows, dv), dtype=RES_DTYPE)
        if self.n_res:
            k[:, :, : self.n_res] = self.res_k[:, :, : self.n_res]
            v[:, :, : self.n_res] = self.res_v[:, :, : self.n_res]
        self.res_k, self.res_v = k, v

    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        s = min(n, self.n_sink)
        parts = []
        if s:
            parts.append(self.sink_k[:, :, :s].astype(dtype))
        if n > s:
            m = n - s
            parts.append(self._decode(self.k_codes[:, :, :m], self.k_scales[:, :, :m], self.k_biases[:, :, :m],
                                      self.kbits, self.k_inv, dtype))
        k = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        return k.swapaxes(-1, -2)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        s = min(n, self.n_sink)
        parts = []
        if s:
            parts.append(self.sink_v[:, :, :s].astype(dtype))
        if n > s:
            m = n - s
            parts.append(self._decode(self.v_codes[:, :, :m], self.v_scales[:, :, :m], self.v_biases[:, :, :m],
                                      self.vbits, self.v_inv, dtype))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _dense(self):
        dtype = getattr(mx, self.dtype_name)
        r = self.n_res
        res = (self.res_k[:, :, :r], self.res_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_sink + self.n_quant, *res, dtype=dtype)

    def stored_rows(self) -> int:
        return self.n_sink + self.n_quant + self.n_res

    def _trim_rows(self, n: int) -> int:
        self._call = None
        if n <= self.n_res:
            self.n_res -= n
            return n
        if self.n_quant == 0 and n <= self.n_res + self.n_sink:
            self.n_sink -= n - self.n_res
            self.n_res = 0
            return n
        raise ValueError(
            f"SKVQKVCache: trimming {n} tokens would reach quantized tokens (only the {self.n_res} "
            f"full-precision window tokens can be dropped exactly: a cache that never saw the trimmed "
            f"tokens would hold some of the remaining ones in its full-precision window)"
        )

    # ---------------------------------------------------------------- accounting
    def theoretical_bytes_per_token(self, d: int, dv: int) -> float:
        """Bytes per quantized token per KV head (codes + float16 scale/bias per channel group)."""
        gk, gv = self.cgroup(d), self.cgroup(dv)
        return (d // gk) * (4 * gq.words_per_group(self.kbits, gk) + 4) + \
            (dv // gv) * (4 * gq.words_per_group(self.vbits, gv) + 4)

    @property
    def used_nbytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        dv = self.res_v.shape[-1]
        held = [self.res_k, self.res_v, self.sink_k, self.sink_v, self.k_perm, self.k_inv, self.v_perm,
                self.v_inv, self.k_alpha, self.v_alpha]
        fixed = sum(a.nbytes for a in held if a is not None)
        return B * H * self.n_quant * int(self.theoretical_bytes_per_token(D, dv)) + fixed

    @property
    def full_seq_bytes(self) -> int:
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        return B * H * self.offset * (D + self.res_v.shape[-1]) * 2
