"""The batch form of the KIVI cache for mlx_lm's ``BatchGenerator``: B requests decoded together, each keeping
exactly the codes, scales and residual rows it would hold alone (``KIVIKVCache.merge`` builds it only when every
cache is exactly a ``KIVIKVCache``: the variants keep raising ``BatchingNotSupported``; ``extract(i)`` gives the
single cache back).

Layout (G = group size): sequence i's groups, at its own absolute positions, fill slots ``[0, nq[i])`` of the
grouped layout's buffers with a leading batch axis (``k_codes [B, H, D, cap*w]``, its scales/biases along the last
axis; values along the rows); later slots are masked and may hold finite leftovers. The float16 residual
``res_k [B, H, R, D]`` is right-aligned (``nr[i] < G`` rows); a residual that completes a group flushes it into
slot ``nq[i]`` (one gather, ``groupquant``, one ``put_along_axis`` for the batch). Counts are host-side ints
(``batch_common``): no per-step sync. ``attend``: the grouped layout's one softmax on the codes with the batch
mask; on CUDA a decode step goes to KIVI's decode kernel with per-sequence counts when the mask is the one
``make_mask`` made (or none), on the CPU to its CPU kernel likewise (``window.batch_finish``). Right-padded
prefill stores only each sequence's first ``lengths[i]`` rows.
"""

from __future__ import annotations

import mlx.core as mx

from ... import kernels
from ...attention import bool_mask, dense_attention
from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...primitives import groupquant as gq
from ..batch_common import (RaggedBatchCache, borrows, grow_slots, keep_right, pad_left, rows_ending_at, rows_from,
                            step_counts, visible_mask)
from ...grouped import RES_DTYPE, GroupedQuantCache
from ...kernels import kivi as kivi_kernel
from ...window import batch_finish, concat_rows
from .kivi import KIVIKVCache


def _head(axis: int, n: int) -> tuple:
    """The index of the first ``n`` entries along ``axis``."""
    return (slice(None),) * axis + (slice(0, n),)


@register_with_mlx_lm
@borrows(GroupedQuantCache, "_init_layout", "value_group", "_key_words", "_uses_qmm", "_keys_t", "_values",
         "_key_scores", "_value_side", "_value_out", "_codes_own", "_codes_part", "_scores_on_codes",
         "_values_on_codes", "_attend_codes", "_cpu_codes_fit", "_cpu_part", "_cpu_store_part", "dequant_only")
class KIVIBatchKVCache(RaggedBatchCache):
    """KIVI's compressed form for B sequences at once (mlx_lm batch-cache protocol)."""

    method_name = "kivi"
    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "res_k", "res_v")
    count_fields = ("nq", "nr", "lens")  # quantized groups, residual rows (< G), tokens held (= nq*G + nr)
    right_fields, right_count = ("res_k", "res_v"), "nr"  # the float16 residual region, right-aligned
    chunk_invariant = True
    exact_trim = False
    trim_exact_or_raises = True
    attend_path = "auto"
    dtype_name = "float16"

    R = property(lambda self: self.right_width)  # the residual's columns

    def size(self) -> int:
        return max(self.nq, default=0) * self.group + self.R

    def _settings(self) -> tuple:
        return (self.qbits, self.group, self.attend_path)

    def _region_dtype(self, compute_dtype):
        return RES_DTYPE

    def _alloc(self, B, dtype=RES_DTYPE, cap=0):
        """Zero buffers for B sequences with ``cap`` group slots and an empty residual region."""
        H, D, Dv = self._shape
        G, w, gv = self.group, self._key_words(), self.value_group(Dv)
        wv, f16 = gq.words_per_group(self.qbits, gv) * (Dv // gv), gq.SCALE_DTYPE
        return {"k_codes": mx.zeros((B, H, D, cap * w), dtype=mx.uint32),
                "k_scales": mx.zeros((B, H, D, cap), dtype=f16), "k_biases": mx.zeros((B, H, D, cap), dtype=f16),
                "v_codes": mx.zeros((B, H, cap * G, wv), dtype=mx.uint32),
                "v_scales": mx.zeros((B, H, cap * G, Dv // gv), dtype=f16),
                "v_biases": mx.zeros((B, H, cap * G, Dv // gv), dtype=f16),
                "res_k": mx.zeros((B, H, 0, D), dtype=dtype), "res_v": mx.zeros((B, H, 0, Dv), dtype=dtype)}

    def _slot_fields(self) -> dict:
        """Group slots: keys' codes/scales along their last axis (transposed layout), values' along rows."""
        G, w = self.group, self._key_words()
        return {"k_codes": (3, w), "k_scales": (3, 1), "k_biases": (3, 1),
                "v_codes": (2, G), "v_scales": (2, G), "v_biases": (2, G)}

    @classmethod
    def from_caches(cls, caches) -> "KIVIBatchKVCache":
        """Batch of single ``KIVIKVCache``s (empty or holding tokens: prompt-cache reuse)."""
        cls._check_mergeable(caches, lambda c: (c.qbits, c.group, c.attend_path), "bits / group size / attend path")
        held = [c for c in caches if getattr(c, "_shape", None) and c.res_k is not None]
        shapes = {tuple(c._shape) for c in held}
        if len(shapes) > 1:
            raise BatchingNotSupported(f"KIVI caches with different head shapes cannot share a batch: {shapes}")
        out = cls(caches[0].config, len(caches))
        out.attend_path = caches[0].attend_path
        if not shapes:
            return out  # nothing stored yet: buffers are allocated by the first update
        out._shape, out.dtype_name = shapes.pop(), held[0].dtype_name
        out.nq, out.nr = [c.n_quant // out.group for c in caches], [c.n_res for c in caches]
        out.lens, out.cap, R = [c.offset for c in caches], max(out.nq), max(out.nr)
        ones = []
        for c, g, r in zip(caches, out.nq, out.nr):  # once per request, not per step
            one = out._alloc(1, cap=out.cap)
            for name, (axis, per) in out._slot_fields().items() if g else ():
                one[name][_head(axis, g * per)] = getattr(c, name)[_head(axis, g * per)]
            for name in ("res_k", "res_v"):
                one[name] = pad_left(getattr(c, name)[:, :, :r].astype(RES_DTYPE) if r else one[name], R)
            ones.append(one)
        return out._stack(ones)

    def extract(self, idx: int) -> KIVIKVCache:
        """Sequence ``idx`` as an ordinary single ``KIVIKVCache`` (the same codes it would hold alone)."""
        idx = int(idx)
        c = KIVIKVCache(self.config)
        if type(self).attend_path != self.attend_path:
            c.attend_path = self.attend_path
        c.offset = self.lens[idx]
        if self.res_k is None:
            return c
        G, g, r, one = self.group, self.nq[idx], self.nr[idx], slice(idx, idx + 1)
        c._shape, c.dtype_name, c.n_quant, c.n_res = self._shape, self.dtype_name, g * G, r
        for name, (axis, per) in self._slot_fields().items() if g else ():
            setattr(c, name, mx.contiguous(getattr(self, name)[(one, *_head(axis, g * per)[1:])]))
        for name in ("res_k", "res_v"):  # the single cache's G-row residual buffer
            setattr(c, name, mx.pad(getattr(self, name)[one, :, self.R - r:], [(0, 0), (0, 0), (0, G - r), (0, 0)]))
        return c

    def _visible(self, N: int, nq, nr, qw: int, R: int) -> mx.array:
        """Boolean [B, 1, N, qw*G + R + N]: per sequence its valid group slots and residual rows, the new rows
        causally."""
        G = self.group
        return visible_mask(N, len(nq), [(qw * G, [q * G for q in nq], "left"), (R, nr, "right")])

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if window_size is not None:
            raise ValueError("KIVIBatchKVCache has no sliding-window mask")
        if self.size() == 0 and not return_array:
            return None if N == 1 else "causal"
        mask = self._visible(N, self.nq, self.nr, max(self.nq, default=0), self.R)
        return self._made(mask, (tuple(self.nq), tuple(self.nr))) if N == 1 else mask

    def _rows(self, qw: int, res_k, res_v, dtype, new=(None, None)):
        """Dense (K, V): ``qw`` dequantized group slots, the residual rows, ``new`` (None, None: nothing)."""
        n = qw * self.group
        parts = ((self._keys_t(n).swapaxes(-1, -2), self._values(n)) if qw else (None, None),
                 (res_k, res_v) if res_k is not None and res_k.shape[2] else (None, None), new)
        return concat_rows(parts, dtype) if any(k is not None for k, _ in parts) else (None, None)

    def _dense(self):
        return self._rows(max(self.nq, default=0), self.res_k, self.res_v, getattr(mx, self.dtype_name))

    def update_and_fetch(self, keys, values):
        valid = self._begin_call(keys, values)
        qw = max(self.nq, default=0)
        self._call = (qw, self.R, list(self.nq), list(self.nr), self.res_k, self.res_v, keys, values)
        self._store(keys, values, valid)
        return self._rows(qw, self._call[4], self._call[5], keys.dtype, (keys, values))

    def _store(self, keys, values, valid):
        B, H, N, D = keys.shape
        G, R = self.group, self.R
        fk = mx.concatenate([self.res_k, keys.astype(RES_DTYPE)], axis=2)  # [B, H, R + N, D]
        fv = mx.concatenate([self.res_v, values.astype(RES_DTYPE)], axis=2)
        start = [R - r for r in self.nr]  # first valid column of each sequence in fk
        total = [r + v for r, v in zip(self.nr, valid)]
        ng, rem = [t // G for t in total], [t % G for t in total]
        K = max(ng)
        if K:  # complete groups: quantize them and write each sequence's into its next slots
            kb, vb = rows_from(fk, start, K * G), rows_from(fv, start, K * G)  # [B, H, K*G, D]
            need = max(q + K for q in self.nq)
            self._set_capacity(need if N > 1 else grow_slots(self.cap, need))  # decode: grow in steps
            self._put_groups(kb, vb, K)
            self.nq = [q + g for q, g in zip(self.nq, ng)]
        R2 = max(rem)
        ends = [R + v for v in valid]  # one past each sequence's last valid column
        # decode: one shared column, a small view; ragged ends or a long call: a fresh small array
        self.res_k = rows_ending_at(fk, ends, R2, view=N < G)
        self.res_v = rows_ending_at(fv, ends, R2, view=N < G)
        self.nr = rem
        self.lens = [n + v for n, v in zip(self.lens, valid)]
        self._sync_offset()

    def _put_groups(self, kb, vb, K):
        """Quantize K groups per sequence (kb/vb [B, H, K*G, D]) into slots nq[i] .. nq[i]+K-1."""
        B, H, _, D = kb.shape
        Dv = vb.shape[-1]
        G, b, w, cap = self.group, self.qbits, self._key_words(), self.cap
        kq = gq.quantize_per_channel(kb, b, G)  # codes [B, H, D, K*w], scales [B, H, D, K]
        vq = gq.quantize(vb, b, self.value_group(Dv))  # codes [B, H, K*G, Wv], scales [B, H, K*G, Dv/Gv]
        slots = mx.array(self.nq, dtype=mx.int32)[:, None] + mx.arange(K, dtype=mx.int32)[None]  # [B, K]
        ks = slots[:, None, None, :]
        self.k_codes = mx.put_along_axis(self.k_codes.reshape(B, H, D, cap, w), ks[..., None],
                                         kq.codes.reshape(B, H, D, K, w), axis=3).reshape(B, H, D, cap * w)
        self.k_scales = mx.put_along_axis(self.k_scales, ks, kq.scales, axis=3)
        self.k_biases = mx.put_along_axis(self.k_biases, ks, kq.biases, axis=3)
        vs = slots[:, None, :, None, None]
        for name, new in (("v_codes", vq.codes), ("v_scales", vq.scales), ("v_biases", vq.biases)):
            buf = getattr(self, name)
            last = buf.shape[-1]
            out = mx.put_along_axis(buf.reshape(B, H, cap, G, last), vs, new.reshape(B, H, K, G, last), axis=2)
            setattr(self, name, out.reshape(B, H, cap * G, last))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N, G = queries.shape[2], self.group
        if call is None or call[6].shape[2] != N or keys.shape[2] != call[0] * G + call[1] + N:
            return dense_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        qw, R, nq, nr, past_k, past_v, new_k, new_v = call
        P = qw * G + R
        if P == 0:  # nothing stored before this call: plain (causal) attention over the new rows
            return dense_attention(queries, new_k, new_v, scale=scale, mask="causal" if N > 1 else None,
                                   sinks=sinks)
        own = self._mask_is_own(mask, (tuple(nq), tuple(nr)))
        if N == 1 and qw and own and self._kernel_ready(queries, new_k, new_v):
            return kernels.checked_call(
                "kivi_batch", self, lambda: self._kernel_attend(queries, call, scale=scale, sinks=sinks),
                lambda: self._attend_call(queries, call, scale=scale, mask=mask, sinks=sinks))
        if N == 1 and qw and own and self._cpu_codes_fit(new_k.shape[-1], new_v.shape[-1],
                                                          queries.shape[1] // new_k.shape[1]):
            return kernels.checked_call(  # the CPU kernel, checked once against the op path
                "kivi_batch_cpu", self, lambda: self._cpu_step(queries, call, scale=scale, sinks=sinks),
                lambda: self._attend_call(queries, call, scale=scale, mask=mask, sinks=sinks))
        return self._attend_call(queries, call, scale=scale, mask=mask, sinks=sinks)

    def _cpu_step(self, queries, call, *, scale, sinks):
        """One query row per sequence by the CPU kernel: its ``nq[i]`` groups (``counts``), then the last ``nr[i]``
        of the residual's columns and its new row (``window.batch_finish``'s spans)."""
        qw, R, nq, nr, past_k, past_v, new_k, new_v = call
        G = self.group
        groups = [((past_k, past_v), [(R - r, r) for r in nr]), ((new_k, new_v), [(0, 1)] * len(nq))]
        return batch_finish(queries, new_k.shape[1], scale, lambda qf: self._cpu_part(qf, qw * G, [q * G for q in nq]),
                            groups, sinks)

    def _attend_call(self, queries, call, *, scale, mask, sinks):
        """The op path over a call record with a stored past: the grouped layout's one softmax, batch mask."""
        qw, R, nq, nr, past_k, past_v, new_k, new_v = call
        N, G = queries.shape[2], self.group
        P = qw * G + R
        m = self._visible(N, nq, nr, qw, R)[:, :, None]  # [B, 1, 1, N, P + N]
        if mask is not None and not isinstance(mask, str) and mask.shape[-2:] == (N, P + N):
            m = m & bool_mask(mask, N, P + N, new_k.shape[1])  # a caller's extra array mask (ours is already in m)
        return self._attend_codes(queries, (qw * G, R, past_k if R else None, past_v if R else None, new_k, new_v),
                                  scale=scale, mask=m, sinks=sinks)

    def _kernel_ready(self, queries, new_k, new_v) -> bool:
        """KIVI's own layout read by the CUDA decode kernel (as the single cache's ``_decode_kernel_ready``)."""
        d, dv = new_k.shape[-1], new_v.shape[-1]
        return (self.attend_path == "auto" and (kernels.kernels_enabled() or kernels.metal_enabled())
                and kivi_kernel.supported(self.qbits, self.group, self.value_group(dv), d, dv,
                                          queries.shape[1] // new_k.shape[1]))

    def _kernel_attend(self, queries, call, *, scale, sinks):
        """One query row per sequence (the kernel with per-sequence counts: its groups, its right-aligned residual
        rows; merged by its last block per head up to ``FUSED_MAX_S1`` partials, ``kernels._common.launch``)."""
        qw, R, nq, nr, past_k, past_v, new_k, new_v = call
        G = self.group
        counts = step_counts([(q * G, R - r, r, 0, 0) for q, r in zip(nq, nr)])
        k0, v0 = (past_k, past_v) if R else (new_k, new_v)
        return kivi_kernel.kivi_partials(queries, scale, self.k_codes, self.k_scales, self.k_biases, self.v_codes,
                                         self.v_scales, self.v_biases, qw * G, self.qbits, G,
                                         self.value_group(new_v.shape[-1]), (k0, v0, 0, k0, v0, 0, new_k, new_v),
                                         counts=counts, merge=kernels.Merge(sinks, False, queries.dtype, self))

    def _check_trim_rows(self, n: int) -> None:
        """Exact while the ``n`` newest tokens are all residual rows."""
        if n > min(self.nr):
            raise ValueError(
                f"KIVIBatchKVCache: trimming {n} tokens would cut into a quantized group of some sequence "
                f"(residual rows per sequence: {self.nr}); extract the sequences and trim them one by one")

    def _trim_rows(self, n: int) -> None:
        R = self.R
        self.nr = [r - n for r in self.nr]
        R2 = max(self.nr)  # the region stays right-aligned: drop the now common invalid prefix
        self.res_k, self.res_v = keep_right(self.res_k[:, :, : R - n], R2), keep_right(self.res_v[:, :, : R - n], R2)
