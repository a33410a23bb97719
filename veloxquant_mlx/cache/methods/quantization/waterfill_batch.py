"""The batch form of the waterfill cache for mlx_lm's ``BatchGenerator``: B requests decoded together, each
keeping exactly the compressed state it would hold alone (``WaterfillKVCache.merge`` builds it when every cache is
exactly a ``WaterfillKVCache`` with the same settings; ``extract(i)`` gives the single cache back).

Layout, mask, flushes, ``trim``, ``filter``/``extend`` and the decode ``attend``: turboquant_rvq's batch form,
with waterfill's storage (``k_words``/``v_words``/``v_scales`` [B, H, cap, .]) and each sequence's calibration
``k_lo``/``k_step``/``k_bits`` and query energies ``q_energy`` [B, H, 1, D] (uniform placeholder widths until
it calibrates). A sequence calibrates when it would alone, from its own rows and valid query rows; until then
its window never flushes. The key layout is one ``VarLayout`` over the B * H width tables, rebuilt (one host
sync) when a sequence calibrates or the batch changes; RoPE is undone at each sequence's own positions, so the
codes are the single cache's bit for bit. A prefill chunk over a stored past attends as the single cache's
``_attend_chunk``; on CUDA a decode step goes to waterfill's decode kernel with per-sequence counts and key
tables when the mask is the one ``make_mask`` made (or none), on the CPU to its CPU kernel likewise (the key table
a row per sequence and head; turboquant_rvq's batch form's ``_cpu_step``). ``nbytes`` also counts ``q_energy``
(kept for later joiners; the single cache drops it once calibrated) and the kernels' tables once built.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from ...attention import group_queries
from ...contract import register_with_mlx_lm
from ...primitives.bitalloc import allocate_bits, rope_pair_mean
from ...primitives.bitpack import packed_words
from ...primitives.fused import elementwise
from ...primitives.keygrid import calibrated_grid, fit_rows
from ...primitives.value_rotation import power_of_two
from ...primitives.varpack import VarLayout, extract_codes
from ...window import SINK_ROWS, ResidualWindowCache
from ... import kernels
from ...kernels import waterfill as wf_kernel
from ..batch_common import borrows, rows_from
from .turboquant_rvq_batch import TurboQuantRVQBatchKVCache
from .waterfill import BLOCK, WaterfillKVCache


@register_with_mlx_lm
@borrows(ResidualWindowCache, "_attend_chunk", "_sinks")
@borrows(WaterfillKVCache, "_init_layout", "bind_attention", "_omega", "_pre_rope", "_post_rope", "_key_codes",
         "_encode_values", "_value_codes", "_weighted_values", "_quantized_part", "_cpu_constants", "_cpu_part",
         "constant_nbytes")
class WaterfillBatchKVCache(TurboQuantRVQBatchKVCache):
    """Waterfill's compressed form for B sequences at once (mlx_lm batch-cache protocol)."""

    method_name = "waterfill"
    single = WaterfillKVCache
    merge_what = "settings (bits, residual length, calibration tokens, seed, RoPE)"
    per_seq = {**TurboQuantRVQBatchKVCache.per_seq, "q_count": "q_count"}
    shared_scalars = ("counts_constants", "rope")
    calib_fields = WaterfillKVCache.calib_fields  # each sequence's calibration, [B, H, 1, D]
    array_fields = ("k_words", "v_words", "v_scales") + calib_fields + ("win_k", "win_v", "sink_k", "sink_v")
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
        return (self.bit_width, self.residual_length, self.n_calib, self.seed, self.rope)

    def _quantizers(self, dk, dv):
        return None  # no shared quantizer objects: each sequence's layout comes from its calibration

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

    @classmethod
    def from_caches(cls, caches):
        out = super().from_caches(caches)
        out.src = [(c.saliency_source or "uniform") if c.calibrated else "" for c in caches]
        return out

    def _merge_one(self, c, one: dict) -> dict:
        one.update({name: getattr(c, name) for name in self.calib_fields if getattr(c, name) is not None})
        return one

    def _extract_one(self, c, idx: int, one: slice):
        if self.src[idx]:
            c.k_lo, c.k_step, c.k_bits = (mx.contiguous(a[one]) for a in (self.k_lo, self.k_step, self.k_bits))
            c.saliency_source = self.src[idx]
        elif self.q_count[idx]:
            c.q_energy = mx.contiguous(self.q_energy[one])
        return c

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self._drop_tables()

    def extend(self, other):
        super().extend(other)
        self._drop_tables()

    def _drop_tables(self) -> None:
        """The batch changed: drop what was built for the old one (the key layout, the decode kernel's tables;
        rebuilt on use), so no array of the old batch stays held uncounted."""
        self._layout = None
        self.__dict__.pop("_kconst", None)
        self.__dict__.pop("_cpuconst", None)

    def _due(self) -> list:
        """Sequences to calibrate now: uncalibrated, holding ``n_calib_tokens`` rows or more."""
        return [i for i, (s, n) in enumerate(zip(self.src, self.lens)) if not s and n >= self.n_calib]

    def _observe(self, queries) -> mx.array:
        """Add each sequence's ``sum q^2`` over its valid query rows of the call (lazy: no host sync;
        calibrated sequences' sums are never read again); returns the call's sum (``attend`` ties it to its
        output, as the single cache does)."""
        H, N = self._shape[0], queries.shape[2]
        valid = self._valid if len(self._valid) == self.batch_size else [N] * self.batch_size
        q = group_queries(queries, H).astype(mx.float32)  # [B, H, rep, N, D]
        if min(valid) < N:  # right-padded rows are not the sequence's queries
            q = mx.where((mx.arange(N)[None] < mx.array(valid)[:, None])[:, None, None, :, None], q, 0.0)
        e = (q * q).sum(axis=(2, 3))[:, :, None, :]
        self.q_energy = self.q_energy + e
        self.q_count = [c if s else c + q.shape[2] * v for c, v, s in zip(self.q_count, valid, self.src)]
        return e

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
        widths[todo] = np.array(allocate_bits(sens.reshape(-1, D), self.bit_width * D)).reshape(sens.shape)
        use = fit_rows(list(self.nw), n, SINK_ROWS)
        k_lo, k_step = calibrated_grid(rows, lo, hi, widths, self.bit_width, use)
        now = mx.array([i in todo for i in range(self.batch_size)])[:, None, None, None]
        self.k_lo, self.k_step = mx.where(now, k_lo, self.k_lo), mx.where(now, k_step, self.k_step)
        self.k_bits = mx.array(widths.astype(np.uint8))[:, :, None, :]
        self.src = [("attention" if self.q_count[i] else "uniform") if i in todo else s for i, s in enumerate(self.src)]
        self._layout = None
        mx.eval(self.k_step, self.k_lo)

    def _flush_counts(self, nw) -> list:
        return [f if s else 0 for f, s in zip(super()._flush_counts(nw), self.src)]  # uncalibrated: no flush

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
        codes = self._key_codes(kb, [SINK_ROWS + q for q in self.nq], lay.mask.reshape(B, H, 1, D))
        kw = lay.pack(codes.reshape(1, B * H, K, D)).reshape(B, H, K, -1)
        vw, vs = self._encode_values(vb)
        self._scatter(K, {"k_words": kw, "v_words": vw, "v_scales": vs})

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

    _quantized_dense = WaterfillKVCache._decoded  # the single cache's op path, on this form's own ``_keys``

    def _key_scores(self, q, a: int, b: int) -> mx.array:
        """The single cache's ``_quantized_part`` scores on the batched key unpacking (``_keys``)."""
        return q @ self._keys(a, b).swapaxes(-1, -2)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        seen = self._observe(queries) if self._held() and not all(self.src) else None
        call, N = self._call, queries.shape[2]
        w = call.window if call is not None else None
        if N > 1 and w is not None and w.new_k.shape[2] == N and keys.shape[2] == w.s0 + w.q0 + w.r0 + N > N:
            # a prefill chunk over a stored past: the single cache's bounded-transient path, the batch mask
            self._call = None
            out = self._attend_chunk(queries, keys, values, w, scale=scale, mask=self._call_mask(call, mask, N),
                                     sinks=sinks)
        else:
            out = super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        due = self._due()
        if due:  # as alone: calibrate at the end of the call, then flush those windows at once
            self._calibrate(due)
            need = max(q + f for q, f in zip(self.nq, self._flush_counts(self.nw)))
            self._set_capacity(max(self.cap, need))  # exact slots for the prompt's codes
            super()._store(self.win_k[:, :, :0], self.win_v[:, :, :0], [0] * self.batch_size)
        return out if seen is None else mx.depends(out, seen)

    def _gpu_step_ready(self, queries) -> bool:
        """Shapes waterfill's decode kernel reads, on CUDA (or Metal)."""
        _, D, DV = self._shape
        return (power_of_two(DV) and wf_kernel.supported(D, DV, self.k_words.shape[-1], self.v_words.shape[-1],
                                                         queries.shape[1] // self.k_words.shape[1])
                and (kernels.kernels_enabled() or kernels.metal_enabled()))

    def _gpu_step(self, queries, call, *, scale, sinks):
        """The single cache's kernel with per-sequence counts (``_step_exact``: its code slots, its sink rows, its
        window rows right-aligned) and the key tables per sequence and head."""
        ktab, lo, step, rope, vpoly = wf_kernel.cache_constants(self)
        counts, exact = self._step_exact(call)
        return wf_kernel.waterfill_partials(queries, scale, self.k_words, ktab, lo, step, rope, self.v_words,
                                            self.v_scales, vpoly, call.window.q0, SINK_ROWS, self.bit_width,
                                            self._shape[2], exact, counts=counts,
                                            merge=kernels.Merge(sinks, True, queries.dtype, self),
                                            paired=wf_kernel.paired_rope(self.rope, self._shape[1]))

    def _batch_cpu_part(self, q, n: int, counts: list):
        return self._cpu_part(q, n, counts, pos0=SINK_ROWS)  # code slot t sits at position SINK_ROWS + t

    def held_arrays(self):
        out = super().held_arrays()
        out += wf_kernel.held_constants(self)  # the decode kernel's tables, once built
        kc = self.__dict__.get("_cpuconst")
        if kc is not None and kc[0] is self.k_lo:  # the CPU kernel's, once built
            out += list(kc[1:])
        if self._layout is not None:
            out += self._layout.arrays()
        return out + ([self._omega_cache] if getattr(self, "_omega_cache", None) is not None else [])


@elementwise  # elementwise only: one fused kernel for any row count
def _dequantize(lo, hi, shift, mask, k_lo, k_step):
    """``k_lo + code * k_step`` from the words gathered for each channel (``VarLayout.gather``)."""
    return k_lo + extract_codes(lo, hi, shift, mask).astype(mx.float32) * k_step
