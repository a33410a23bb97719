"""The batch form of the waterfill cache: several requests decoded together by mlx_lm's
``BatchGenerator`` (continuous batching), each keeping exactly the compressed state it would hold alone.

``WaterfillKVCache.merge(caches)`` builds a ``WaterfillBatchKVCache`` (only when every cache is exactly a
``WaterfillKVCache`` with the same bits, window, calibration length, seed and RoPE); ``extract(i)`` gives
back an ordinary ``WaterfillKVCache`` with the same sink rows, codes, calibration and window.

Layout: turboquant_rvq's batch form (``turboquant_rvq_batch.py``: float16 sink rows and code slots
left-aligned per sequence, the float16 window right-aligned, flushed in whole blocks of 16 beyond the
newest R rows; the mask, ``trim``, ``filter``/``extend`` and the one-softmax decode ``attend`` are its), with
waterfill's storage: key words at each sequence's own per-channel widths, rotated per-token value codes
and their float16 RMS (``k_words``/``v_words``/``v_scales`` [B, H, cap, .]), and each sequence's
calibration ``k_lo``/``k_step``/``k_bits`` [B, H, 1, D] (uniform placeholder widths until it is
calibrated) and query energies ``q_energy`` [B, H, 1, D] float32.

Calibration is per sequence and happens when it would alone: at the end of the first attended call
after which the sequence holds ``n_calib_tokens`` rows (or, without the dispatch point, at the next
call), from its own rows and its own valid query rows (right-padded rows are left out); until then its
window never flushes. The key layout is one ``VarLayout`` over the B * H (sequence, head) width tables,
rebuilt (one host sync) when a sequence calibrates or the batch changes; rows are encoded with RoPE
undone at each sequence's own positions (``rotate_rows`` with per-row offsets), so the codes are the
single cache's bit for bit. Encoding, value decoding and the quantized scores are the single cache's
(``_encode_values``, ``_value_codes``, ``_quantized_tiles``); only the batched key unpacking differs.

A prefill chunk over a stored past attends as the single cache's (``_attend_chunk``: fused attention
over the returned rows on a GPU, online softmax over tiles elsewhere; no prompt-sized score matrix),
the batch mask hiding each sequence's invalid slots. Limit: decode attends on the op path (the single
cache's fused CUDA decode kernel reads one sequence's layout).

``nbytes`` = the arrays held (codes with spare slots, sink rows, window, calibration, ``q_energy``
kept for the batch's later joiners -- the single cache drops it once calibrated), the width layout's
tables, the RoPE angles and, for the first layer, a non-power-of-two ``Dv``'s rotation.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ...attention import bool_mask, group_queries
from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...primitives.bitalloc import allocate_bits, rope_pair_mean
from ...primitives.bitpack import packed_words
from ...primitives.value_rotation import rotate_values
from ...primitives.rope import rotate_rows
from ...primitives.varpack import VarLayout, extract_codes
from ...window import SINK_ROWS, ResidualWindowCache, WindowCall
from ..batch_common import borrows, rows_from
from .turboquant_rvq_batch import TurboQuantRVQBatchKVCache
from .waterfill import BLOCK, WaterfillKVCache

_CODES = ("k_words", "v_words", "v_scales")
_CALIB = ("k_lo", "k_step", "k_bits", "q_energy")


def _settings(c) -> tuple:
    return (c.bit_width, c.residual_length, c.n_calib, c.seed, c.rope)


@register_with_mlx_lm
@borrows(ResidualWindowCache, "_quantized_part", "_attend_chunk")
@borrows(WaterfillKVCache, "_init_layout", "bind_attention", "_omega", "_pre_rope", "_encode_values",
         "_value_codes", "constant_nbytes")
class WaterfillBatchKVCache(TurboQuantRVQBatchKVCache):
    """Waterfill's compressed form for B sequences at once (mlx_lm batch-cache protocol)."""

    method_name = "waterfill"
    array_fields = _CODES + _CALIB + ("win_k", "win_v", "sink_k", "sink_v")
    # sink rows, code slots, window rows, tokens held, query rows seen, saliency source ("" = uncalibrated)
    count_fields = ("ns", "nq", "nw", "lens", "q_count", "src")
    state_scalars = ("cap", "dtype_name", "counts_constants", "rope")
    quant_block = BLOCK
    chunk_invariant = False  # as the single cache: calibrated once, on the first calls
    rope = None
    _layout = None
    _valid: list = []  # valid rows of the latest call per sequence (prepare's lengths)
    _shared = WaterfillKVCache._shared

    def _settings(self) -> tuple:
        return _settings(self)

    def _quantizers(self, dk, dv):
        return None  # no shared quantizer objects: each sequence's layout comes from its calibration

    # ---------------------------------------------------------------- allocation
    def _code_widths(self) -> dict:
        _, D, Dv = self._shape
        return {"k_words": (packed_words(D, self.bit_width),), "v_words": (packed_words(Dv, self.bit_width),),
                "v_scales": ()}

    def _alloc(self, B, dtype, cap=0, W=0) -> dict:
        out = super()._alloc(B, dtype, cap, W)
        out["v_scales"] = out["v_scales"].astype(mx.float16)
        z = mx.zeros((B, self._shape[0], 1, self._shape[1]))
        out.update(k_lo=z.astype(mx.float16), k_step=z.astype(mx.float16),
                   k_bits=(z + self.bit_width).astype(mx.uint8), q_energy=z)  # placeholder widths: uniform
        return out

    def _layout_of(self) -> VarLayout:
        """The key layout of every (sequence, head): ``VarLayout`` groups [B * H] (one host sync per rebuild)."""
        if self._layout is None:
            self._layout = VarLayout(np.array(self.k_bits).reshape(-1, self._shape[1]))
        return self._layout

    # ---------------------------------------------------------------- batch protocol
    @classmethod
    def from_caches(cls, caches) -> "WaterfillBatchKVCache":
        """Batch of single ``WaterfillKVCache``s (empty, calibrated or not: prompt-cache reuse)."""
        first = caches[0]
        cls._check_mergeable(caches, _settings, "settings (bits, residual length, calibration tokens, seed, RoPE)")
        held = [c for c in caches if c.win_k is not None]
        shapes, dtypes = {tuple(c._shape) for c in held}, {c.win_k.dtype for c in held}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise BatchingNotSupported(f"waterfill caches with different head shapes / storage dtypes cannot "
                                       f"share a batch: {shapes}, {dtypes}")
        out = cls(first.config, len(caches))
        out.counts_constants, out.rope = first.counts_constants, first.rope
        if not held:
            return out  # nothing stored yet: buffers are allocated by the first update
        out._shape, out.dtype_name = shapes.pop(), held[0].dtype_name
        out.ns, out.nq, out.nw = [c.n_sink for c in caches], [c.n_quant for c in caches], [c.n_win for c in caches]
        out.lens, out.q_count = [c.offset for c in caches], [c.q_count for c in caches]
        out.src = [(c.saliency_source or "uniform") if c.calibrated else "" for c in caches]
        out.cap, W = max(out.nq), max(out.nw)
        dtype = dtypes.pop()
        ones = []
        for c, s, q, w in zip(caches, out.ns, out.nq, out.nw):  # once per request, not per step
            one = out._alloc(1, dtype, out.cap, W)
            for names, n, cols in ((_CODES, q, slice(0, q)), (("sink_k", "sink_v"), s, slice(0, s)),
                                   (("win_k", "win_v"), w, slice(W - w, W))):
                for name in names if n else ():
                    one[name][:, :, cols] = getattr(c, name)[:, :, :n]
            one.update({name: getattr(c, name) for name in _CALIB if getattr(c, name) is not None})
            ones.append(one)
        return out._stack(ones)

    def extract(self, idx: int) -> WaterfillKVCache:
        """Sequence ``idx`` as an ordinary ``WaterfillKVCache`` (the same state it would hold alone)."""
        idx = int(idx)
        c = WaterfillKVCache(self.config)
        c.counts_constants, c.rope, c.offset, c.q_count = self.counts_constants, self.rope, self.lens[idx], \
            self.q_count[idx]
        if self.win_k is None:
            return c
        s, q, w = self.ns[idx], self.nq[idx], self.nw[idx]
        c._shape, c.dtype_name = self._shape, self.dtype_name
        c.n_sink, c.n_quant, c.n_win = s, q, w
        one = slice(idx, idx + 1)
        for names, n, cols in ((_CODES, q, slice(0, q)), (("sink_k", "sink_v"), s, slice(None)),
                               (("win_k", "win_v"), True, slice(self.W - w, None))):  # the window, even empty
            for name in names if n else ():
                setattr(c, name, mx.contiguous(getattr(self, name)[one, :, cols]))
        if self.src[idx]:
            c.k_lo, c.k_step, c.k_bits = (mx.contiguous(a[one]) for a in (self.k_lo, self.k_step, self.k_bits))
            c.saliency_source = self.src[idx]
        elif self.q_count[idx]:
            c.q_energy = mx.contiguous(self.q_energy[one])
        return c

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self._layout = None

    def extend(self, other):
        super().extend(other)
        self._layout = None

    # ---------------------------------------------------------------- calibration
    def _due(self) -> list:
        """Sequences to calibrate now: uncalibrated, holding ``n_calib_tokens`` rows or more."""
        if all(self.src):
            return []
        return [i for i, (s, n) in enumerate(zip(self.src, self.lens)) if not s and n >= self.n_calib]

    def _observe(self, queries) -> None:
        """Add each sequence's ``sum q^2`` over its valid query rows of the call (lazy: no host sync;
        calibrated sequences' sums are never read again)."""
        H, N = self._shape[0], queries.shape[2]
        valid = self._valid if len(self._valid) == self.batch_size else [N] * self.batch_size
        q = group_queries(queries, H).astype(mx.float32)  # [B, H, rep, N, D]
        if min(valid) < N:  # right-padded rows are not the sequence's queries
            q = mx.where((mx.arange(N)[None] < mx.array(valid)[:, None])[:, None, None, :, None], q, 0.0)
        self.q_energy = self.q_energy + (q * q).sum(axis=(2, 3))[:, :, None, :]
        self.q_count = [c if s else c + q.shape[2] * v for c, v, s in zip(self.q_count, valid, self.src)]

    def _calibrate(self, todo) -> None:
        """``WaterfillKVCache._calibrate`` for the sequences ``todo`` (their windows hold all their rows):
        ranges over their rows but the sinks, widths from their own query energies."""
        D = self._shape[1]
        n = max(self.nw[i] for i in todo)
        rows = self._pre_rope(rows_from(self.win_k, [self.W - w for w in self.nw], n), 0)  # row j: position j
        j = mx.arange(n)[None]
        first = mx.array([SINK_ROWS if w > SINK_ROWS else 0 for w in self.nw])[:, None]
        body = ((j >= first) & (j < mx.array(self.nw)[:, None]))[:, None, :, None]
        lo = mx.where(body, rows, mx.inf).min(axis=2, keepdims=True)  # [B, H, 1, D]
        hi = mx.where(body, rows, -mx.inf).max(axis=2, keepdims=True)
        w = self.q_energy[:, :, 0]
        if self.rope is not None:  # a pre-RoPE channel meets both channels of its rotary pair
            w = rope_pair_mean(w.reshape(-1, D), self.rope).reshape(w.shape)
        w = mx.where(mx.array([c > 0 for c in self.q_count])[:, None, None], w, 1.0)  # none seen: uniform
        sens = np.array(w * ((hi - lo) ** 2)[:, :, 0])[todo]
        widths = np.array(self.k_bits)[:, :, 0].astype(np.int64)
        widths[todo] = allocate_bits(sens.reshape(-1, D), self.bit_width * D).reshape(sens.shape)
        levels = mx.array((2 ** widths - 1).astype(np.float32))[:, :, None, :]
        zero, now = levels == 0, mx.array([i in todo for i in range(self.batch_size)])[:, None, None, None]
        step = mx.where(zero, 0.0, (hi - lo) / mx.maximum(levels, 1.0)).astype(mx.float16)
        self.k_step = mx.where(now, step, self.k_step)
        self.k_lo = mx.where(now, mx.where(zero, (lo + hi) / 2, lo).astype(mx.float16), self.k_lo)
        self.k_bits = mx.array(widths.astype(np.uint8))[:, :, None, :]
        self.src = [("attention" if self.q_count[i] else "uniform") if i in todo else s for i, s in enumerate(self.src)]
        self._layout = None
        mx.eval(self.k_step, self.k_lo)

    def _flush_counts(self, nw) -> list:
        return [f if s else 0 for f, s in zip(super()._flush_counts(nw), self.src)]  # uncalibrated: no flush

    # ---------------------------------------------------------------- storage
    def _store(self, keys, values, valid):
        self._valid = valid
        due = self._due()
        if due:  # the previous call was never attended (no dispatch point): no query weights
            self._calibrate(due)
        super()._store(keys, values, valid)

    def _put_codes(self, kb, vb, K):
        """Encode K rows per sequence (kb/vb [B, H, K, D]) into slots nq[i] .. nq[i] + K - 1, as
        ``WaterfillKVCache._append_quantized`` (a sequence that writes codes holds its SINK_ROWS sinks)."""
        B, H, _, D = kb.shape
        lay = self._layout_of()
        step, lo = self.k_step.astype(mx.float32), self.k_lo.astype(mx.float32)
        codes = mx.round((self._pre_rope(kb, [SINK_ROWS + q for q in self.nq]) - lo) / mx.where(step > 0, step, 1.0))
        codes = mx.clip(codes, 0, lay.mask.reshape(B, H, 1, D).astype(mx.float32))
        kw = lay.pack(codes.astype(mx.uint32).reshape(1, B * H, K, D)).reshape(B, H, K, -1)
        vw, vs = self._encode_values(vb)
        slots = mx.array(self.nq, dtype=mx.int32)[:, None] + mx.arange(K, dtype=mx.int32)[None]  # [B, K]
        for name, rows in (("k_words", kw), ("v_words", vw), ("v_scales", vs)):
            idx = slots[:, None, :] if rows.ndim == 3 else slots[:, None, :, None]
            setattr(self, name, mx.put_along_axis(getattr(self, name), idx, rows, axis=2))

    def _keys(self, a: int, b: int) -> mx.array:
        """Decoded keys of code slots ``a .. b`` of every sequence, RoPE re-applied (codes start at
        position SINK_ROWS; slots past a sequence's count are masked): [B, H, b - a, D] float32."""
        words = self.k_words[:, :, a:b]
        B, H, n, _ = words.shape
        D = self._shape[1]
        lay = self._layout_of()
        lo, hi = lay.gather(words.reshape(1, B * H, n, -1))
        flat = [x.reshape(1, B * H, 1, D).astype(mx.float32) for x in (self.k_lo, self.k_step)]
        pre = _dequantize(lo, hi, lay.shift[:, None].astype(mx.uint32), lay.mask[:, None].astype(mx.uint32), *flat)
        return self._post_rope(pre.reshape(B, H, n, D), SINK_ROWS + a)

    def _post_rope(self, k: mx.array, offset) -> mx.array:
        return rotate_rows(k, self.rope, self._omega(), offset) if self.rope is not None else k

    def _quantized_dense(self, n):
        v = self._value_codes(0, n) * self.v_scales[:, :, :n, None].astype(mx.float32)
        return self._keys(0, n), rotate_values(v, self.seed, inverse=True)

    def _quantized_tiles(self, q, ranges):
        """Per range of code slots: scores on the keys decoded there and ``sum_t p_t s_t centroid[code_t]``,
        rotated back once (the single cache's tiles, on the batched key unpacking)."""
        def values(p, a, b):
            vs = self.v_scales[:, :, a:b].astype(mx.float32)[:, :, None, :]
            return rotate_values((p * vs) @ self._value_codes(a, b), self.seed, inverse=True)

        return [(lambda a=a, b=b: q @ self._keys(a, b).swapaxes(-1, -2), lambda p, a=a, b=b: values(p, a, b))
                for a, b in ranges]

    # ---------------------------------------------------------------- attention
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if self._held() and not all(self.src):
            self._observe(queries)
        call, N = self._call, queries.shape[2]
        if N > 1 and call is not None and call.new_k.shape[2] == N and keys.shape[2] == sum(call.widths) + N > N:
            # a prefill chunk over a stored past: the single cache's bounded-transient path, the batch mask
            self._call = None
            S0, qw, W0 = call.widths
            m = self._visible(N, call.ns, call.nq, call.nw, W0)
            if mask is not None and not isinstance(mask, str) and mask.shape[-2:] == m.shape[-2:]:
                m = m & bool_mask(mask, N, m.shape[-1])[:, :, 0]  # a caller's extra array mask
            wc = WindowCall(S0, qw, W0, call.past_k, call.past_v, call.new_k, call.new_v)
            out = self._attend_chunk(queries, keys, values, wc, scale=scale, mask=m, sinks=sinks)
        else:
            out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        due = self._due()
        if due:  # as alone: calibrate at the end of the call, then flush those windows at once
            self._calibrate(due)
            need = max(q + f for q, f in zip(self.nq, self._flush_counts(self.nw)))
            self._set_capacity(max(self.cap, need))  # exact slots for the prompt's codes
            super()._store(self.win_k[:, :, :0], self.win_v[:, :, :0], [0] * self.batch_size)
        return out

    # ---------------------------------------------------------------- accounting
    def held_arrays(self):
        out = super().held_arrays()
        if self._layout is not None:
            out += self._layout.arrays()
        return out + ([self._omega_cache] if getattr(self, "_omega_cache", None) is not None else [])


@functools.partial(mx.compile, shapeless=True)  # elementwise only: one fused kernel for any row count
def _dequantize(lo, hi, shift, mask, k_lo, k_step):
    """``k_lo + code * k_step`` from the words gathered for each channel (``VarLayout.gather``)."""
    return k_lo + extract_codes(lo, hi, shift, mask).astype(mx.float32) * k_step
