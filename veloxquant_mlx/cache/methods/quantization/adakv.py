"""Importance-aware mixed-precision KV quantization ("adakv"): per-token hi / mid / lo widths by importance at a
target average width, on KIVI's layout.

Paper: MiKV (Yang, Kim, Bae, Kwon, Park, Yang, Kwon, Lee, "No Token Left Behind: Reliable KV Cache Compression
via Importance-Aware Mixed Precision Quantization", arXiv 2402.18096): keep every token, the important ones at
high precision. (The name is historical: Ada-KV, arXiv 2407.11550, is per-head budget allocation for eviction.)

A quantized group's tokens are ranked by importance; fixed counts per group (``nonuniform.tier_counts``) get
``adakv_hi_bit``, ``adakv_mid_bit`` and ``adakv_lo_bit`` (coding: ``amc.RankTiers``). ``adakv_importance``:
``"attention"`` (MiKV's signal: the dispatch point's real queries, the last ``adakv_obs_window`` of each call,
summed over the KV head's query heads, averaged over a token's observations; without the dispatch point
``"norm_variance"`` ranks), ``"norm"`` (‖k‖₂) or ``"norm_variance"`` (var(k) · (1 + var(v))). Against the
importance-blind control (``allocation = "uniform"``): docs/RESULTS.md, "adakv and xquant".

Deviations from MiKV: MiKV keeps an H2O-style accumulated attention over the whole generation and rebalances
query/key outlier channels; here a token's tier is fixed when its group is quantized (``adakv_update_interval``
is unused), attention is normalized over the call's full-precision rows, no channel balancing, three tiers
instead of two, keys post-RoPE. With ``"attention"`` the stored form depends on how the prompt was split into
calls (``chunk_invariant`` holds for the norms).

A CPU decode step reads each tier's codes in one pass of the latent kernel (``native/latent_cpu.cpp``, as AMC's:
``RankTiers._cpu_part``), the key ranges and the values' per-token ranges read where they are stored (``_cpu_tier``);
the op path decoded every row each step (SmolLM2's layer at 8k: ~18 ms against the plain cache's ~4, then ~4).
"""

from __future__ import annotations

import mlx.core as mx

from ... import dispatch
from ...attention import group_queries
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import nonuniform as sal
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.buffers import grow_rows
from .amc import TIERS, RankTiers, range_code, range_decode
from .kivi import RES_DTYPE, KIVIKVCache


@register_with_mlx_lm
@register("adakv")
class AdaKVKVCache(RankTiers, KIVIKVCache):
    """MiKV-style per-token hi/mid/lo bit widths by importance at a target average; KIVI per-channel keys."""
    chunk_invariant = True  # norm importances: per-group tiers, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = tuple(f"{s}_codes_{t}" for t in TIERS for s in "kv") + (
        "k_mins", "k_rngs", "v_mins", "v_rngs", "order", "res_k", "res_v", "res_score", "res_cnt")
    allocation = "importance"  # or "uniform": an importance-blind control, same tiers and bytes (tests)
    _pending = None  # (t0, keys, values) of the groups this call stored, for attend to re-rank
    _prev_scores = None  # the past residual rows' (accumulated attention, observations) before this call
    dequant_only = "per-head bit widths"
    realized_avg_bits = RankTiers.code_bits

    def _init_layout(self):
        o = self.config.options
        self.group, self.qbits, self._pending = o.group_size, o.hi_bit, None
        self.tier_bits = dict(zip(TIERS, (o.hi_bit, o.mid_bit, o.lo_bit)))
        counts = sal.tier_counts(float(o.target_avg_bits), o.lo_bit, o.mid_bit, o.hi_bit, self.group)
        self.counts = dict(zip(TIERS, counts))

    @property
    def uses_attention(self) -> bool:
        return self.config.options.importance == "attention"

    def _rank(self, kb, vb, imp=None) -> mx.array:
        """Within-group order [B, H, g, G] (positions by decreasing importance, or the uniform pattern)."""
        B, H, n, _ = kb.shape
        G = self.group
        g = n // G
        if self.allocation == "uniform":  # stride pattern: every tier spread evenly over the group
            stride = max(1, G // max(1, self.counts["hi"] + self.counts["mid"]))
            j = mx.arange(G)
            pattern = mx.argsort((j % stride) * G + j // stride)
            return mx.broadcast_to(pattern, (B, H, g, G)).astype(mx.int32)
        if imp is None:
            kind = "norm_variance" if self.uses_attention else self.config.options.importance
            imp = sal.token_importance(kb, vb, kind)
        return mx.argsort(-imp.reshape(B, H, g, G), axis=-1)

    def _append_groups(self, kb, vb, imp=None):
        G = self.group
        (B, H, n, D), Dv = kb.shape, vb.shape[-1]
        g, t0 = n // G, self.n_quant
        if self.uses_attention and imp is None and dispatch.installed():
            self._pending = (t0, kb, vb)  # attend re-ranks these groups with the real queries, then drops them
        order = self._rank(kb, vb, imp)
        kg = kb.astype(mx.float32).reshape(B, H, g, G, D)
        k_mn = kg.min(axis=3).astype(RES_DTYPE)  # per channel per group [B, H, g, D]
        k_rng = (kg.max(axis=3) - k_mn.astype(mx.float32)).astype(RES_DTYPE)
        ks = mx.take_along_axis(kg, order[..., None], axis=3)  # rank order
        cg = self._cg(Dv)
        vs = mx.take_along_axis(vb.astype(mx.float32).reshape(B, H, g, G, Dv), order[..., None], axis=3)
        vs = vs.reshape(B, H, g, G, Dv // cg, cg)
        v_mn = vs.min(axis=-1).astype(RES_DTYPE)  # per token per channel group, rank order
        v_rng = (vs.max(axis=-1) - v_mn.astype(mx.float32)).astype(RES_DTYPE)
        for t, c, b, start in self._tiers():
            sl = slice(start, start + c)
            kc = range_code(ks[:, :, :, sl], k_mn[:, :, :, None], k_rng[:, :, :, None], b)
            vc = range_code(vs[:, :, :, sl], v_mn[:, :, :, sl, :, None], v_rng[:, :, :, sl, :, None], b)
            for side, codes, d in (("k", kc, D), ("v", vc, Dv)):
                packed = pack_bits(codes.reshape(B, H, g * c, d), b)
                setattr(self, f"{side}_codes_{t}", grow_rows(getattr(self, f"{side}_codes_{t}"), (t0 // G) * c, packed))
        self.k_mins = grow_rows(self.k_mins, t0 // G, k_mn)
        self.k_rngs = grow_rows(self.k_rngs, t0 // G, k_rng)
        self.v_mins = grow_rows(self.v_mins, t0, v_mn.reshape(B, H, n, Dv // cg))
        self.v_rngs = grow_rows(self.v_rngs, t0, v_rng.reshape(B, H, n, Dv // cg))
        self.order = grow_rows(self.order, t0, order.reshape(B, H, n).astype(mx.uint8))
        self.n_quant = t0 + n

    def _store(self, keys, values):
        self._pending = None
        if not self.uses_attention:
            return super()._store(keys, values)
        B, H, N, _ = keys.shape
        G = self.group
        if self.res_score is None:
            self.res_score = mx.zeros((B, H, G), dtype=mx.float32)
            self.res_cnt = mx.zeros((G,), dtype=mx.float32)
        r0 = self.n_res
        self._prev_scores = (self.res_score[:, :, :r0], self.res_cnt[:r0])
        super()._store(keys, values)
        # the call's rows start unobserved (attend adds the observations); kept residual rows keep theirs
        if r0 + N < G:
            self.res_score[:, :, r0 : r0 + N] = 0.0
            self.res_cnt[r0 : r0 + N] = 0.0
        else:
            self.res_score = mx.zeros_like(self.res_score)
            self.res_cnt = mx.zeros_like(self.res_cnt)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, pending = self._call, self._pending
        self._pending = None
        if self.uses_attention and call is not None and call[4].shape[2] == queries.shape[2] \
                and keys.shape[2] == call[0] + call[1] + queries.shape[2]:
            self._observe(queries, call, pending, scale)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _observe(self, queries, call, pending, scale):
        """Attention of the call's last ``obs_window`` queries on its full-precision rows (past residual +
        new rows), summed over the query heads of each KV head; completes groups' ranks, accumulates the rest."""
        _, r0, past_k, _, new_k, _ = call
        B, Hq, N, D = queries.shape
        H = new_k.shape[1]
        W = min(self.config.options.obs_window, N)
        fk = new_k if not r0 else mx.concatenate([past_k.astype(new_k.dtype), new_k], axis=2)
        total = r0 + N
        q = group_queries(queries[:, :, N - W :], H).astype(mx.float32) * scale  # [B, H, rep, W, D]
        s = q @ fk.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [B, H, rep, W, total]
        qpos = r0 + N - W + mx.arange(W)  # position of each observing query among the columns
        seen = mx.arange(total)[None, :] <= qpos[:, None]  # [W, total] causal
        p = mx.softmax(mx.where(seen, s, -mx.inf), axis=-1, precise=True)
        score = p.sum(axis=(2, 3))  # [B, H, total]
        cnt = seen.astype(mx.float32).sum(axis=0)  # observations per column
        prev_s, prev_c = self._prev_scores
        self._prev_scores = None
        if r0:
            score = mx.concatenate([score[:, :, :r0] + prev_s, score[:, :, r0:]], axis=2)
            cnt = mx.concatenate([cnt[:r0] + prev_c, cnt[r0:]])
        G = self.group
        nq = (total // G) * G
        if nq and pending is not None and pending[1].shape[2] == nq:
            t0, kb, vb = pending
            self.n_quant = t0  # re-rank the groups this call stored (same rows, same tiers: same shapes)
            self._append_groups(kb, vb, imp=score[:, :, :nq] / mx.maximum(cnt[:nq], 1.0))
        rem = total - nq
        if rem:
            self.res_score[:, :, :rem] = score[:, :, nq:]
            self.res_cnt[:rem] = cnt[nq:]

    def _decode(self, side: str, n: int, dtype) -> mx.array:
        G, d = self.group, getattr(self, f"res_{side}").shape[-1]
        g = n // G
        B, H = self.res_k.shape[:2]
        cg = self._cg(d)
        parts = []
        for t, c, b, start in self._tiers():
            codes = unpack_bits(getattr(self, f"{side}_codes_{t}")[:, :, : g * c], b, d).reshape(B, H, g, c, d)
            if side == "k":
                x = range_decode(codes, self.k_mins[:, :, :g, None], self.k_rngs[:, :, :g, None], b)
            else:
                mn, rg = (a[:, :, :n].reshape(B, H, g, G, d // cg)[:, :, :, start : start + c, :, None]
                          for a in (self.v_mins, self.v_rngs))
                x = range_decode(codes.reshape(B, H, g, c, d // cg, cg), mn, rg, b).reshape(B, H, g, c, d)
            parts.append(x)
        return self._in_token_order(parts, n, d).astype(dtype)

    def _cpu_tier(self, t: str, c: int, start: int) -> tuple:
        """Read in place: the key ranges group-major, each value row on its group's range and minimum, found in
        the rank-ordered per-token arrays (row i of the tier at rank ``start + i % c`` of group ``i // c``)."""
        return ((getattr(self, f"k_codes_{t}"), self.k_rngs, self.k_mins, getattr(self, f"v_codes_{t}"),
                 self.v_rngs, self.v_mins),
                {"k_group_major": True, "v_row_ranges": True, "v_scale_rows": [c, self.group, start]})

    def _trim_rows(self, n: int) -> int:
        self._pending = None
        return super()._trim_rows(n)

    def _tier_nbytes(self, rows: int, b: int, D: int, Dv: int) -> int:
        """Bytes of ``rows`` tier rows at ``b`` bits: codes, the values' float16 minimum and range per group."""
        return rows * (4 * (packed_words(D, b) + packed_words(Dv, b)) + (Dv // self._cg(Dv)) * 4)

    @property
    def used_nbytes(self) -> int:
        """``RankTiers``' bytes plus, with ``"attention"``, the residual rows' accumulated scores."""
        return super().used_nbytes + sum(a.nbytes for a in (self.res_score, self.res_cnt) if a is not None)
