"""Importance-aware mixed-precision KV quantization: per-token bit widths (hi / mid / lo) chosen by token
importance at a target average bit width, on KIVI's layout.

Paper: the design the spec's fields describe (``adakv_target_avg_bits``, ``adakv_lo/mid/hi_bit``,
``adakv_importance``, ``adakv_obs_window``) is MiKV's (Yang, Kim, Bae, Kwon, Park, Yang, Kwon, Lee, "No
Token Left Behind: Reliable KV Cache Compression via Importance-Aware Mixed Precision Quantization",
arXiv 2402.18096): instead of evicting the tokens an attention-based importance score ranks low, keep
*every* token, the important ones at high precision and the rest at low precision. The name ``adakv``
is historical: Ada-KV (arXiv 2407.11550) is per-head budget allocation for *eviction*, not this.

Algorithm (a ``KIVIKVCache`` subclass: same float16 residual of < G tokens, same ``update_and_fetch`` /
one-softmax ``attend``; G = ``adakv_group_size``). When a G-token group is quantized, its tokens are
ranked by importance; the top ``n_hi`` get ``adakv_hi_bit``, the next ``n_mid`` ``adakv_mid_bit``, the
rest ``adakv_lo_bit``, the counts fixed per group (``nonuniform.tier_counts``) so the realized average
is the target up to whole tokens (|error| <= (hi - lo) / 2G).

* Keys are quantized **per channel** as in KIVI (one float16 minimum and range per channel per group,
  shared by every token of the group) and each token's entries are coded on that range at its own
  tier's width: ``step_b = range / (2^b - 1)``. So the metadata costs what KIVI's does and the per-channel
  outliers that make per-token key quantization fail (KIVI, section 3) stay absorbed by the range.
* Values are quantized **per token** (channel groups of gcd(Dv, 32), float16 minimum and range) at the
  token's width.
* Importance (``adakv_importance``):
  - ``"attention"`` (MiKV's signal): the attention a token receives from the model's real queries (the
    dispatch point's), over the last ``adakv_obs_window`` queries of each call, summed over the query
    heads of its KV head and averaged over the observations it got (a token that waits in the residual
    during decoding accumulates one observation per step). Without the dispatch point no query is seen
    and the group keeps the ``"norm_variance"`` ranking it was stored with.
  - ``"norm"``: ‖k_t‖₂; ``"norm_variance"``: var(k_t) · (1 + var(v_t)) (``nonuniform.token_importance``),
    the library's query-free proxies.
* Storage: per tier, the packed codes of exactly that tier's rows (``{k,v}_codes_{hi,mid,lo}``), the
  keys' per-channel ``k_mins``/``k_rngs`` [B, H, groups, D], the values' per-token ``v_mins``/``v_rngs``
  (rank order), and the within-group rank order ``order`` (uint8 per token) that puts rows back in
  token order; with ``"attention"``, the residual rows' accumulated attention and observation counts.

Measured (``veloxquant eval --task kld``: SmolLM2-135M, 1024 essay tokens prefilled + 64 scored decode
steps, KL vs the uncompressed cache, CPU, 2026-12-01; every adakv row holds 0.269-0.270x the fp16 bytes):
``"attention"`` KLD 0.058 vs 0.076 for the importance-blind control with the same tiers and bytes
(``allocation = "uniform"``), so MiKV's signal earns the mixed widths their place over uniform allocation.
The query-free proxies lose to that control on this model: ``"norm_variance"`` (the spec's default) 0.144,
``"norm"`` 0.127 (ranking by the *inverse* key norm, 0.111, loses too). KIVI for reference: 2 bits 0.193 at
0.220x, 3 bits 0.030 at 0.283x -- at these bytes uniform 3-bit KIVI is still better than 2.5-bit tiers.

Deviations from MiKV: MiKV evicts-and-keeps by an H2O-style accumulated attention over the whole
generation and rebalances query/key outlier channels; here a token's tier is fixed once, when its group
is quantized (``adakv_update_interval`` is not used: no re-allocation afterwards), attention is
normalized over the full-precision rows of the call (residual + new rows: the same ranking per query),
no channel balancing, three tiers instead of two, keys post-RoPE. With ``"attention"`` the stored form
depends on how the prompt was split into calls (the class's ``chunk_invariant`` holds for the norm
importances only).
"""

from __future__ import annotations


import mlx.core as mx

from ...attention import group_queries
from ... import dispatch
from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.buffers import grow_rows
from ...primitives import nonuniform as sal
from .amc import TIERS, RankTiers
from .kivi import RES_DTYPE, KIVIKVCache



def _range_code(x: mx.array, mn: mx.array, rng: mx.array, bits: int) -> mx.array:
    """Codes of ``x`` on ``[mn, mn + rng]`` at ``bits`` bits (``mn``/``rng`` broadcast, float16-rounded)."""
    levels = float((1 << bits) - 1)
    step = rng.astype(mx.float32) / levels
    q = mx.round((x.astype(mx.float32) - mn.astype(mx.float32)) / mx.where(step > 0, step, 1.0))
    return mx.clip(q, 0.0, levels).astype(mx.uint32)


def _range_decode(codes: mx.array, mn: mx.array, rng: mx.array, bits: int) -> mx.array:
    return codes.astype(mx.float32) * (rng.astype(mx.float32) / float((1 << bits) - 1)) + mn.astype(mx.float32)


@register_with_mlx_lm
@register("adakv")
class AdaKVKVCache(RankTiers, KIVIKVCache):
    """MiKV-style per-token hi/mid/lo bit widths by importance at a target average; KIVI per-channel keys."""
    chunk_invariant = True  # norm importances: per-group tiers, groups at absolute positions
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a group

    array_fields = tuple(f"{s}_codes_{t}" for t in TIERS for s in "kv") + (
        "k_mins", "k_rngs", "v_mins", "v_rngs", "order", "res_k", "res_v", "res_score", "res_cnt")
    scalar_fields = ("n_quant", "n_res", "dtype_name")

    #: "importance" (the method) or "uniform" (an importance-blind control with the same tiers and bytes:
    #: a fixed in-group pattern); tests set it per instance.
    allocation = "importance"
    _pending = None  # (t0, keys, values) of the groups this call stored, for attend to re-rank
    _prev_scores = None  # the past residual rows' (accumulated attention, observations) before this call

    def _init_layout(self):
        o = self.config.options  # validation checked the types, widths in 1..8 and the importance names
        lo, mid, hi, t = o.lo_bit, o.mid_bit, o.hi_bit, o.target_avg_bits
        if not lo < mid < hi:
            raise QuantizerConfigError("adakv_mid_bit", mid, f"strictly between adakv_lo_bit={lo} and adakv_hi_bit={hi}")
        if not lo <= t <= hi:
            raise QuantizerConfigError("adakv_target_avg_bits", t, f"a number in [{lo}, {hi}]")
        if not 2 <= o.group_size <= 256:
            raise QuantizerConfigError("adakv_group_size", o.group_size, "an int in 2..256")
        self.group = G = o.group_size
        self.tier_bits = {"hi": hi, "mid": mid, "lo": lo}
        n_hi, n_mid, n_lo = sal.tier_counts(float(t), lo, mid, hi, G)
        self.counts = {"hi": n_hi, "mid": n_mid, "lo": n_lo}
        self.qbits = hi
        self._call = None
        self._pending = None

    @property
    def uses_attention(self) -> bool:
        return self.config.options.importance == "attention"

    dequant_only = "per-head bit widths"

    realized_avg_bits = RankTiers.code_bits

    # ---------------------------------------------------------------- encode
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
        B, H, n, D = kb.shape
        Dv = vb.shape[-1]
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
        start = 0
        for t in TIERS:  # three tiers, not a loop over tokens
            c, b = self.counts[t], self.tier_bits[t]
            if c:
                r0 = (t0 // G) * c
                sl = slice(start, start + c)
                kc = _range_code(ks[:, :, :, sl], k_mn[:, :, :, None], k_rng[:, :, :, None], b)
                vc = _range_code(vs[:, :, :, sl], v_mn[:, :, :, sl, :, None], v_rng[:, :, :, sl, :, None], b)
                kc = pack_bits(kc.reshape(B, H, g * c, D), b)
                vc = pack_bits(vc.reshape(B, H, g * c, Dv), b)
                setattr(self, f"k_codes_{t}", grow_rows(getattr(self, f"k_codes_{t}"), r0, kc))
                setattr(self, f"v_codes_{t}", grow_rows(getattr(self, f"v_codes_{t}"), r0, vc))
            start += c
        self.k_mins = grow_rows(self.k_mins, t0 // G, k_mn)
        self.k_rngs = grow_rows(self.k_rngs, t0 // G, k_rng)
        self.v_mins = grow_rows(self.v_mins, t0, v_mn.reshape(B, H, n, Dv // cg))
        self.v_rngs = grow_rows(self.v_rngs, t0, v_rng.reshape(B, H, n, Dv // cg))
        self.order = grow_rows(self.order, t0, order.reshape(B, H, n).astype(mx.uint8))
        self.n_quant = t0 + n

    def _store(self, keys, values):
        self._pending = None
        if self.uses_attention:
            B, H, N, _ = keys.shape
            G = self.group
            if self.res_score is None:
                self.res_score = mx.zeros((B, H, G), dtype=mx.float32)
                self.res_cnt = mx.zeros((G,), dtype=mx.float32)
            r0 = self.n_res
            prev = (self.res_score[:, :, :r0], self.res_cnt[:r0])
            super()._store(keys, values)
            # the call's rows start unobserved (attend adds the observations); kept residual rows keep theirs
            self._prev_scores = prev
            total = r0 + N
            if total < G:
                self.res_score[:, :, r0:total] = 0.0
                self.res_cnt[r0:total] = 0.0
            else:
                self.res_score = mx.zeros_like(self.res_score)
                self.res_cnt = mx.zeros_like(self.res_cnt)
        else:
            super()._store(keys, values)

    # ---------------------------------------------------------------- attention importance (real queries)
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
        col = mx.arange(total)
        qpos = r0 + N - W + mx.arange(W)  # position of each observing query among the columns
        seen = col[None, :] <= qpos[:, None]  # [W, total] causal
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

    # ---------------------------------------------------------------- decode
    def _rows_of(self, side: str, n: int, d: int) -> mx.array:
        G = self.group
        g = n // G
        B, H = self.res_k.shape[:2]
        cg = self._cg(d)
        parts, start = [], 0
        for t in TIERS:
            c, b = self.counts[t], self.tier_bits[t]
            if c:
                codes = unpack_bits(getattr(self, f"{side}_codes_{t}")[:, :, : g * c], b, d).reshape(B, H, g, c, d)
                if side == "k":
                    x = _range_decode(codes, self.k_mins[:, :, :g, None], self.k_rngs[:, :, :g, None], b)
                else:
                    mn = self.v_mins[:, :, :n].reshape(B, H, g, G, d // cg)[:, :, :, start : start + c, :, None]
                    rg = self.v_rngs[:, :, :n].reshape(B, H, g, G, d // cg)[:, :, :, start : start + c, :, None]
                    x = _range_decode(codes.reshape(B, H, g, c, d // cg, cg), mn, rg, b).reshape(B, H, g, c, d)
                parts.append(x)
            start += c
        return self._in_token_order(parts, n, d)

    # ---------------------------------------------------------------- trim
    def _trim_rows(self, n: int) -> int:
        self._pending = None
        return super()._trim_rows(n)

    # ---------------------------------------------------------------- accounting
    def _tier_nbytes(self, rows: int, b: int, D: int, Dv: int) -> int:
        """Bytes of ``rows`` tier rows at ``b`` bits: key and value codes, the values' float16 minimum and
        range per channel group."""
        return rows * (4 * (packed_words(D, b) + packed_words(Dv, b)) + (Dv // self._cg(Dv)) * 4)

    @property
    def used_nbytes(self) -> int:
        """``RankTiers``' bytes plus, with ``"attention"``, the residual rows' accumulated scores."""
        extra = sum(a.nbytes for a in (self.res_score, self.res_cnt) if a is not None)
        return super().used_nbytes + extra
