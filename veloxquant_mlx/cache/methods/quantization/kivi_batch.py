"""The batch form of the KIVI cache: several requests decoded together by mlx_lm's ``BatchGenerator``
(continuous batching), each keeping exactly the compressed state it would hold alone.

``KIVIKVCache.merge(caches)`` builds a ``KIVIBatchKVCache`` (only when every cache is exactly a
``KIVIKVCache``: the KIVI variants keep raising ``BatchingNotSupported``); ``extract(i)`` gives back an
ordinary ``KIVIKVCache`` with the same codes, scales and residual rows as an unbatched run.

Layout (B sequences, H kv heads, D / Dv head dims, G = ``kivi_group_size``, b bits). Every sequence
keeps its own groups of G tokens at its own absolute positions 0, G, 2G, ... (as the single cache),
so a request's codes do not depend on the batch it runs in:

* quantized region, groups left-aligned per sequence: sequence i's groups fill slots
  ``[0, nq[i])`` of ``k_codes [B, H, D, cap*w]``, ``k_scales``/``k_biases [B, H, D, cap]`` (KIVI's
  transposed per-channel layout) and ``v_codes [B, H, cap*G, Wv]``, ``v_scales``/``v_biases
  [B, H, cap*G, Dv/Gv]``; slots ``>= nq[i]`` are invalid for it (masked out of the scores; they may
  hold leftovers, always finite). ``cap`` grows in steps.
* float16 residual region, right-aligned: ``res_k [B, H, R, D]``, ``res_v [B, H, R, Dv]`` with
  ``R = max(nr)``; sequence i's ``nr[i] < G`` rows are the last ``nr[i]`` columns. A decode step
  appends one shared column; a sequence whose residual completes a group flushes its G rows into
  its slot ``nq[i]`` (one gather over the batch, ``groupquant``, one ``put_along_axis`` scatter; the
  sequences that flush nothing write a throw-away group into their own first invalid slot), and the
  region's common invalid prefix is sliced off, so ``R < G`` after every call.

All per-sequence counts (``nq``, ``nr``, ``lens``) are host-side Python ints derived from the call
sizes and ``prepare``'s lengths: the decode path never syncs with the device, and nothing loops over
tokens, heads or sequences per step (``merge``/``extract``/``extend``/``filter`` loop over the
sequences once per request).

``update_and_fetch`` returns [dequantized quantized region (max(nq)*G rows), residual region (R rows),
new rows (N)] and ``make_mask`` the boolean mask [B, 1, N, M] that hides each sequence's invalid
slots and keeps the new rows causal; ``attend`` (dispatch point) computes the same attention on the
codes (KIVI's one-softmax form over [quantized part, residual + new rows], ``mx.quantized_matmul``
where KIVI's ``_uses_qmm`` says so). Right-padded batched prefill (``prepare(lengths=,
right_padding=)``): only each sequence's first ``lengths[i]`` rows of the call are stored; padded rows
come after every valid row of their sequence, so the causal structure already hides them from valid
queries; ``finalize`` has nothing to move. ``offset`` is an ``mx.array`` of the sequences' positions
(RoPE of a valid row j of sequence i is ``lens[i] + j``).

``nbytes`` = the arrays held: codes, float16 scales/biases (with the buffers' spare group slots) and the
float16 residual region; no dense copy of the quantized rows is kept.
"""

from __future__ import annotations

import mlx.core as mx

from ...attention import bool_mask
from ...contract import BatchingNotSupported, register_with_mlx_lm
from ...primitives import groupquant as gq
from ..batch_common import RaggedBatchCache, borrows, grow_slots, keep_right, rows_ending_at, rows_from, visible_mask
from ...grouped import RES_DTYPE, GroupedQuantCache
from .kivi import KIVIKVCache

_Q_FIELDS = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")


@register_with_mlx_lm
@borrows(GroupedQuantCache, "value_group", "_key_words", "_uses_qmm", "_keys_t", "_values", "_key_scores", "_value_out",
         "_codes_own", "_scores_on_codes", "_values_on_codes", "_attend_codes", "dequant_only")
class KIVIBatchKVCache(RaggedBatchCache):
    """KIVI's compressed form for B sequences at once (mlx_lm batch-cache protocol)."""

    method_name = "kivi"
    array_fields = _Q_FIELDS + ("res_k", "res_v")
    count_fields = ("nq", "nr", "lens")  # quantized groups, residual rows (< G), tokens held (= nq*G + nr)
    right_fields, right_count = ("res_k", "res_v"), "nr"  # the float16 residual region, right-aligned
    chunk_invariant = True
    exact_trim = False
    trim_exact_or_raises = True

    attend_path = "auto"
    dtype_name = "float16"


    def __init__(self, config, batch_size: int = 0):
        super().__init__(config)
        self.cap = 0  # group slots allocated
        self._init_counts(batch_size)

    def _init_layout(self):
        GroupedQuantCache._init_layout(self)

    # ---------------------------------------------------------------- bookkeeping
    @property
    def R(self) -> int:
        return 0 if self.res_k is None else self.res_k.shape[2]

    def size(self) -> int:
        return max(self.nq, default=0) * self.group + self.R

    def _settings(self) -> tuple:
        return (self.qbits, self.group, self.attend_path)

    # ---------------------------------------------------------------- allocation
    def _region_dtype(self, compute_dtype):
        return RES_DTYPE

    def _alloc(self, B, dtype=RES_DTYPE, cap=0):
        """Zero buffers for B sequences with ``cap`` group slots and an empty residual region."""
        H, D, Dv = self._shape
        G, w = self.group, self._key_words()
        gv = self.value_group(Dv)
        wv = gq.words_per_group(self.qbits, gv) * (Dv // gv)
        f16 = gq.SCALE_DTYPE
        return {
            "k_codes": mx.zeros((B, H, D, cap * w), dtype=mx.uint32),
            "k_scales": mx.zeros((B, H, D, cap), dtype=f16),
            "k_biases": mx.zeros((B, H, D, cap), dtype=f16),
            "v_codes": mx.zeros((B, H, cap * G, wv), dtype=mx.uint32),
            "v_scales": mx.zeros((B, H, cap * G, Dv // gv), dtype=f16),
            "v_biases": mx.zeros((B, H, cap * G, Dv // gv), dtype=f16),
            "res_k": mx.zeros((B, H, 0, D), dtype=dtype),
            "res_v": mx.zeros((B, H, 0, Dv), dtype=dtype),
        }

    def _slot_fields(self) -> dict:
        """Group slots: keys' codes/scales along their last axis (transposed layout), values' along rows."""
        G, w = self.group, self._key_words()
        return {"k_codes": (3, w), "k_scales": (3, 1), "k_biases": (3, 1),
                "v_codes": (2, G), "v_scales": (2, G), "v_biases": (2, G)}

    # ---------------------------------------------------------------- batch protocol
    @classmethod
    def from_caches(cls, caches) -> "KIVIBatchKVCache":
        """Batch of single ``KIVIKVCache``s (empty or holding tokens: prompt-cache reuse)."""
        first = caches[0]
        cls._check_mergeable(caches, lambda c: (c.qbits, c.group, c.attend_path), "bits / group size / attend path")
        shapes = {tuple(c._shape) for c in caches if getattr(c, "_shape", None) and c.res_k is not None}
        if len(shapes) > 1:
            raise BatchingNotSupported(f"KIVI caches with different head shapes cannot share a batch: {shapes}")
        out = cls(first.config, len(caches))
        out.attend_path = first.attend_path
        if not shapes:
            return out  # nothing stored yet: buffers are allocated by the first update
        H, D, Dv = shapes.pop()
        G, w = out.group, out._key_words()
        held = [c for c in caches if c.res_k is not None]
        out.dtype_name = held[0].dtype_name
        out._shape = (H, D, Dv)
        out.nq = [c.n_quant // G for c in caches]
        out.nr = [c.n_res for c in caches]
        out.lens = [c.offset for c in caches]
        R = max(out.nr)
        out.cap = max(out.nq)
        ones = []
        for c, g, r in zip(caches, out.nq, out.nr):  # once per request, not per step
            one = out._alloc(1, cap=out.cap)
            if g:
                one["k_codes"][..., : g * w] = c.k_codes[..., : g * w]
                for name in ("k_scales", "k_biases"):
                    one[name][..., :g] = getattr(c, name)[..., :g]
                for name in ("v_codes", "v_scales", "v_biases"):
                    one[name][:, :, : g * G] = getattr(c, name)[:, :, : g * G]
            for name, src, d in (("res_k", c.res_k, D), ("res_v", c.res_v, Dv)):
                pad = mx.zeros((1, H, R - r, d), dtype=RES_DTYPE)
                one[name] = mx.concatenate([pad, src[:, :, :r].astype(RES_DTYPE)], axis=2) if r else pad
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
        G, w = self.group, self._key_words()
        g, r = self.nq[idx], self.nr[idx]
        H, D, Dv = self._shape
        c._shape = self._shape
        c.dtype_name = self.dtype_name
        c.n_quant, c.n_res = g * G, r
        one = slice(idx, idx + 1)
        if g:
            c.k_codes = mx.contiguous(self.k_codes[one, ..., : g * w])
            c.k_scales = mx.contiguous(self.k_scales[one, ..., :g])
            c.k_biases = mx.contiguous(self.k_biases[one, ..., :g])
            c.v_codes = mx.contiguous(self.v_codes[one, :, : g * G])
            c.v_scales = mx.contiguous(self.v_scales[one, :, : g * G])
            c.v_biases = mx.contiguous(self.v_biases[one, :, : g * G])
        R = self.R
        c.res_k = mx.concatenate([self.res_k[one, :, R - r:], mx.zeros((1, H, G - r, D), RES_DTYPE)], axis=2)
        c.res_v = mx.concatenate([self.res_v[one, :, R - r:], mx.zeros((1, H, G - r, Dv), RES_DTYPE)], axis=2)
        return c

    # ---------------------------------------------------------------- masks
    def _visible(self, N: int, nq, nr, qw: int, R: int) -> mx.array:
        """Boolean [B, 1, N, qw*G + R + N]: per sequence, its valid group slots, its residual rows,
        and the new rows causally."""
        G = self.group
        return visible_mask(N, len(nq), [(qw * G, [q * G for q in nq], "left"), (R, nr, "right")])

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if window_size is not None:
            raise ValueError("KIVIBatchKVCache has no sliding-window mask")
        qw, R = max(self.nq, default=0), self.R
        if qw == 0 and R == 0 and not return_array:
            return None if N == 1 else "causal"
        return self._visible(N, self.nq, self.nr, qw, R)

    # ---------------------------------------------------------------- storage
    def _dense_past(self, qw: int, res_k, res_v, dtype):
        ks, vs = [], []
        if qw:
            ks.append(self._keys_t(qw * self.group).swapaxes(-1, -2).astype(dtype))
            vs.append(self._values(qw * self.group).astype(dtype))
        if res_k is not None and res_k.shape[2]:
            ks.append(res_k.astype(dtype))
            vs.append(res_v.astype(dtype))
        return ks, vs

    def update_and_fetch(self, keys, values):
        valid = self._begin_call(keys, values)
        qw = max(self.nq, default=0)
        self._call = (qw, self.R, list(self.nq), list(self.nr), self.res_k, self.res_v, keys, values)
        self._store(keys, values, valid)
        ks, vs = self._dense_past(qw, self._call[4], self._call[5], keys.dtype)
        if not ks:
            return keys, values
        return mx.concatenate(ks + [keys], axis=2), mx.concatenate(vs + [values], axis=2)

    def _store(self, keys, values, valid):
        B, H, N, D = keys.shape
        G, R = self.group, self.R
        fk = mx.concatenate([self.res_k, keys.astype(RES_DTYPE)], axis=2)  # [B, H, R + N, D]
        fv = mx.concatenate([self.res_v, values.astype(RES_DTYPE)], axis=2)
        start = [R - r for r in self.nr]  # first valid column of each sequence in fk
        total = [r + v for r, v in zip(self.nr, valid)]
        ng = [t // G for t in total]
        rem = [t - g * G for t, g in zip(total, ng)]
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

    def _dense(self):
        dtype = getattr(mx, self.dtype_name)
        ks, vs = self._dense_past(max(self.nq, default=0), self.res_k, self.res_v, dtype)
        if not ks:
            return None, None
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    # ---------------------------------------------------------------- attention on the codes
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is None or call[6].shape[2] != N:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        qw, R, nq, nr, past_k, past_v, new_k, new_v = call
        G = self.group
        P = qw * G + R
        if keys.shape[2] != P + N:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if P == 0:  # nothing stored before this call: plain (causal) attention over the new rows
            return mx.fast.scaled_dot_product_attention(queries, new_k, new_v, scale=scale,
                                                        mask="causal" if N > 1 else None, sinks=sinks)
        m = self._visible(N, nq, nr, qw, R)[:, :, None]  # [B, 1, 1, N, P + N]
        if mask is not None and not isinstance(mask, str) and mask.shape[-2:] == (N, P + N):
            m = m & bool_mask(mask, N, P + N, new_k.shape[1])  # a caller's extra array mask (ours is already in m)
        return self._attend_codes(queries, (qw * G, R, past_k if R else None, past_v if R else None, new_k, new_v),
                                  scale=scale, mask=m, sinks=sinks)

    # ---------------------------------------------------------------- trim
    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens of every sequence: exact while they are all residual rows."""
        n = int(n)
        if n <= 0 or not self.lens:
            return 0
        if n > min(self.nr):
            raise ValueError(
                f"KIVIBatchKVCache: trimming {n} tokens would cut into a quantized group of some sequence "
                f"(residual rows per sequence: {self.nr}); extract the sequences and trim them one by one")
        self._call = None
        R = self.R
        self.res_k, self.res_v = self.res_k[:, :, : R - n], self.res_v[:, :, : R - n]
        self.nr = [r - n for r in self.nr]
        # the region stays right-aligned: shift by dropping the now common invalid prefix
        R2 = max(self.nr)
        self.res_k, self.res_v = keep_right(self.res_k, R2), keep_right(self.res_v, R2)
        self.lens = [x - n for x in self.lens]
        self._sync_offset()
        return n
