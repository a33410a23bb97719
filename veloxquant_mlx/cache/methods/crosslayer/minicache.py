"""MiniCache (Liu, Liu, Pan, He, Haffari, Zhuang, "MiniCache: KV Cache Compression in Depth Dimension for
Large Language Models", arXiv 2405.14366): from mid-depth on adjacent layers' KV states point alike, so a pair of
layers keeps per-token magnitudes per layer and one SLERP of the two directions; token pairs too far apart are
retained exactly. Here the first ``floor(minicache_start_frac · L)`` layers and an unpaired last one are lossless
primaries, then (primary, merge) pairs keep rows in a float16 window (``GroupWindow``) until the merge layer holds
``BLOCK`` rows and merges both windows (keys and values apart; cosine < ``minicache_retention_threshold``:
retained). The primary holds the shared direction (its own row where retained) and magnitudes ``pn`` (1 where
retained), the merge layer ``mn`` and its retained rows (``ret`` float16, token-major ``idx``): 2·D + 4 + retained
fraction · (2·D + 4) bytes per token and KV head for the pair, vs 4·D. A block of ``BLOCK`` tokens whose merged form
(keys and values together) would take at least the bytes of both layers' float16 rows is kept as those rows instead
(``raw_k``/``raw_v``, both layers; ``runs``: the blocks' forms in token order): exact, never above two float16
layers, and read in place by the CPU decode (native ``joint_finish``); a lossless primary holds only such rows. One
host sync per merge step (the blocks' retained counts).

Deviations: a fixed cosine threshold (the paper: relative angular distance); the primary restores merged tokens
from the shared direction, its retained rows there with magnitude 1 (a lossless primary plus a direction would
exceed two float16 layers); blocks kept raw when merging them saves nothing (not in the paper);
``minicache_group_size`` must be 2; ``minicache_max_ctx`` unused; the newest < ``BLOCK`` tokens stay float16;
tokens merged with trimmed ones stay merged, and trims must hit every layer alike; a cache built alone is a
lossless primary.

Measured (``veloxquant eval --task kld``, SmolLM2-135M float32, CPU, 512-token essay + 32 decode steps, t = 0.5):
55% of merge-layer rows have cosine < 0 with their primary, so θ = 0.9 (default) retains all: every block raw (KL
7e-7, the sums' order; kv/fp16 1.00, was 1.064 with every row merged-and-retained); θ = 0: KL 0.444, kv/fp16 0.914
(0.962 before raw blocks and 1/32 slack); θ = -1: 0.845, 0.812 (0.837). The paper's premise fails on this model.
"""

from __future__ import annotations

import uuid

import mlx.core as mx
import numpy as np

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives import blocks
from ...primitives.buffers import grow_rows, reserve_rows
from ...window import Partials, finish_partials, scaled_rows
from ..layer_links import GroupWindow, relink, relinking_state
from ..quantization.kivi import RES_DTYPE, KIVIKVCache, SideRows

BLOCK = 32  # window rows merged at once (one host sync per merge step)
_EPS = 1e-6


class MiniCacheCoordinator:
    """Links the layers of one prompt cache: primaries publish themselves, merge layers fetch them by group id."""

    def __init__(self, uid: str | None = None):
        self.uid, self.primaries = uid or uuid.uuid4().hex, {}

    def fetch(self, group_id: int) -> "MiniCacheKVCache":
        if group_id not in self.primaries:
            raise RuntimeError(f"MiniCache: no primary published for group {group_id}")
        return self.primaries[group_id]


def slerp(a: mx.array, b: mx.array, t: float) -> mx.array:
    """Spherical interpolation ``(sin((1-t)Ω) a + sin(tΩ) b) / sin Ω`` between unit vectors a, b [..., D]."""
    omega = mx.arccos(mx.clip(mx.sum(a * b, axis=-1, keepdims=True), -1.0, 1.0))
    so = mx.sin(omega)
    small = so < 1e-4
    safe = mx.where(small, 1.0, so)
    out = (mx.where(small, 1.0 - t, mx.sin((1.0 - t) * omega) / safe) * a
           + mx.where(small, t, mx.sin(t * omega) / safe) * b)
    return out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), _EPS)


def merge_pair(xp: mx.array, xm: mx.array, t: float, threshold: float):
    """Merge rows [B, H, n, D] of the primary (xp) and the merge layer (xm): (shared direction, primary
    magnitude, merge magnitude, retain mask [B, H, n]); retained rows keep xp as direction, magnitude 1."""
    xp, xm = xp.astype(mx.float32), xm.astype(mx.float32)
    np_, nm = mx.linalg.norm(xp, axis=-1, keepdims=True), mx.linalg.norm(xm, axis=-1, keepdims=True)
    ep, em = xp / mx.maximum(np_, _EPS), xm / mx.maximum(nm, _EPS)
    retain = mx.sum(ep * em, axis=-1) < threshold
    return mx.where(retain[..., None], xp, slerp(ep, em, t)), mx.where(retain[..., None], 1.0, np_), nm, retain


def raw_blocks(retained_k, retained_v, heads: int, dk: int, dv: int) -> np.ndarray:
    """Per block of ``BLOCK`` tokens: whether its merged form -- per token and KV head a direction and two magnitudes
    (2·D + 4 bytes a side), plus 2·D + 4 bytes a retained row (``retained_k/v``: counts over the block's ``heads``
    rows) -- takes at least the bytes of both layers' float16 rows (4·D a side), so it is kept as those rows."""
    per_row = np.array([2 * dk + 4, 2 * dv + 4])
    merged = heads * BLOCK * per_row.sum() + np.stack([retained_k, retained_v], axis=-1) @ per_row
    return merged >= heads * BLOCK * 4 * (dk + dv)


@register_with_mlx_lm
@register("minicache")
class MiniCacheKVCache(GroupWindow, SideRows, KIVIKVCache):
    """MiniCache cross-layer merging for one layer (role "primary" or "merge"; see the module doc)."""
    chunk_invariant, exact_trim = True, False  # whole blocks; rows merged with trimmed ones stay
    trim_exact_or_raises = False
    array_fields = ("res_k", "res_v", "raw_k", "raw_v", "dir_k", "dir_v", "pn_k", "pn_v", "mn_k", "mn_v",
                    "ret_k", "idx_k", "ret_v", "idx_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "mc_role", "mc_group", "mc_uid", "mc_readers",
                     "n_retained_k", "n_retained_v", "n_raw", "runs")
    attend_path = "dequant"

    def __init__(self, config, role: str = "primary", group_id: int = 0, coordinator=None, n_readers: int = 1):
        if role not in ("primary", "merge"):
            raise QuantizerConfigError("role", role, "'primary' or 'merge'")
        super().__init__(config)
        self.mc_role, self.mc_group, self.coordinator = role, int(group_id), coordinator
        self.mc_uid = coordinator.uid if coordinator is not None else ""
        self.mc_readers = 0  # a primary built alone has no reader: lossless
        self.n_retained_k = self.n_retained_v = 0
        self.n_raw, self.runs = 0, []  # tokens kept as float16 rows; [[kept raw (0/1), tokens], ...] in token order
        if coordinator is None and role == "merge":
            raise QuantizerConfigError("coordinator", None, "a MiniCacheCoordinator for role='merge'")
        if coordinator is not None and role == "primary":
            self.mc_readers = int(n_readers)
            coordinator.primaries[self.mc_group] = self

    def _init_layout(self):
        self.group, self.qbits = BLOCK, 16  # options: group_size is 2 (pairs of adjacent layers)

    dequant_only = "merged cross-layer codes"
    _key_words = staticmethod(lambda: 0)  # KIVI's attend reads it; no codes here

    @classmethod
    def build_layers(cls, layer_configs):
        """Lossless primaries below ``floor(start_frac · L)`` and last if unpaired, (primary, merge) pairs between."""
        L, coord = len(layer_configs), MiniCacheCoordinator()
        start = int(layer_configs[0].options.start_frac * L) if L else 0
        return [cls(cfg, "primary", group_id=i, coordinator=coord, n_readers=int(i >= start and i + 1 < L))
                if i < start or (i - start) % 2 == 0 else cls(cfg, "merge", group_id=i - 1, coordinator=coord)
                for i, cfg in enumerate(layer_configs)]

    role = property(lambda self: self.mc_role)
    group_id = property(lambda self: self.mc_group)
    primary = property(lambda self: self.coordinator.fetch(self.mc_group))

    def _relink_loaded(self):
        self._runs_changed()  # (a loaded state's runs: no memo of the object's earlier ones applies)
        primary = self.mc_role == "primary"
        self.coordinator = relink(f"{self.mc_uid}:{self.mc_group}", primary,
                                  lambda: MiniCacheCoordinator(self.mc_uid), "MiniCacheKVCache: the primary")
        if primary:
            self.coordinator.primaries[self.mc_group] = self

    state = relinking_state()

    def _store(self, keys, values):
        m = self._append_window(keys, values)
        if m:
            self._compress_block(m)
        blocks.settle_prefill(keys.shape[2], self._held_with_primary)

    def _compress_block(self, m: int) -> None:
        """The window's first ``m`` rows (whole blocks): merged by a merge layer, kept by a lone primary."""
        if self.mc_role == "merge":
            p = self.primary
            if (p.n_quant, p.n_res) != (self.n_quant, self.n_res):
                raise RuntimeError("MiniCacheKVCache: the primary layer must be fed the same tokens first "
                                   f"(primary {p.n_quant}+{p.n_res}, merge {self.n_quant}+{self.n_res})")
            self._merge_block(p, m)
        elif self.mc_readers == 0:  # no partner: lossless, every block kept raw
            for kind in ("k", "v"):
                self._append(f"raw_{kind}", self.n_raw, getattr(self, f"res_{kind}")[:, :, :m])
            self._keep(np.ones(m // BLOCK, bool))
            self._advance(m)
        # a paired primary waits for its merge layer, which merges both windows

    def _held_with_primary(self) -> list:
        """This layer's arrays and a merge layer's primary's (which it wrote): what a prefill call waits for before
        the layer's attention is queued (``blocks.settle_prefill``; left to the chunk's end, every layer's rows were
        alive together: SmolLM2, 1023 tokens in one chunk, 1.19x the plain cache's peak)."""
        held = self.held_arrays()
        return held + self.primary.held_arrays() if self.mc_role == "merge" else held

    def _append(self, name: str, at: int, new: mx.array) -> None:
        """Write rows at row ``at`` of array ``name`` (float16), with ``reserve_rows``' slack: 1/32, 16 rows at least
        (a short chat's layer holds at most ``contract.SHORT_PROMPT_SLACK_ROWS`` spare rows)."""
        new = new.astype(RES_DTYPE)
        setattr(self, name, grow_rows(reserve_rows(getattr(self, name), at, new, BLOCK // 2), at, new))

    def _keep(self, raw: np.ndarray) -> None:
        """Record the forms of the next ``len(raw)`` blocks (``runs``) and count the raw ones' tokens."""
        cuts = np.r_[0, np.flatnonzero(raw[1:] != raw[:-1]) + 1, raw.size]
        for a, b in zip(cuts[:-1], cuts[1:]):
            flag, rows = int(raw[a]), int(b - a) * BLOCK
            if self.runs and self.runs[-1][0] == flag:
                self.runs[-1][1] += rows
            else:
                self.runs.append([flag, rows])
        self.n_raw += int(raw.sum()) * BLOCK
        self._runs_changed()

    def _merge_block(self, p, m):
        o = self.config.options
        B, H = self.res_k.shape[:2]
        nb = m // BLOCK
        parts = {kind: (getattr(p, f"res_{kind}")[:, :, :m], getattr(self, f"res_{kind}")[:, :, :m])
                 for kind in ("k", "v")}
        merged = {kind: merge_pair(xp, xm, float(o.slerp_t), float(o.retention_threshold))
                  for kind, (xp, xm) in parts.items()}
        counts = np.array(mx.stack([merged[k][3].reshape(B, H, nb, BLOCK).sum(axis=(0, 1, 3)) for k in "kv"]))
        raw = raw_blocks(counts[0], counts[1], B * H, self.res_k.shape[-1], self.res_v.shape[-1])  # (the sync)
        pick = lambda a, sel: a if sel.all() else mx.take(a, mx.array(block_rows(sel)), axis=2)  # noqa: E731
        t0 = self.n_quant - self.n_raw  # merged tokens before this step
        for i, kind in enumerate(("k", "v")):
            (xp, xm), (d, pn, mn, retain) = parts[kind], merged[kind]
            if raw.any():
                p._append(f"raw_{kind}", p.n_raw, pick(xp, raw))
                self._append(f"raw_{kind}", self.n_raw, pick(xm, raw))
            if raw.all():
                continue
            p._append(f"dir_{kind}", t0, pick(d, ~raw))
            p._append(f"pn_{kind}", t0, pick(pn, ~raw))
            self._append(f"mn_{kind}", t0, pick(mn, ~raw))
            r = int(counts[i][~raw].sum())
            if r:  # retained rows, compact, in token-major flat order: merged position (t0 + i) * B*H + (b*H + h)
                flat_ret = pick(retain, ~raw).transpose(2, 0, 1).reshape(-1)
                D = xm.shape[-1]
                pos = mx.arange(flat_ret.size, dtype=mx.int32)
                order = mx.argsort(mx.where(flat_ret, pos, pos + flat_ret.size))[:r].astype(mx.int32)
                rows = pick(xm, ~raw).transpose(2, 0, 1, 3).reshape(-1, D)[order]
                for name, new in (("ret", rows), ("idx", order + t0 * B * H)):
                    old = getattr(self, f"{name}_{kind}")
                    setattr(self, f"{name}_{kind}", new if old is None else mx.concatenate([old, new]))
                setattr(self, f"n_retained_{kind}", getattr(self, f"n_retained_{kind}") + r)
        for c in (p, self):
            c._keep(raw)
            c._advance(m)

    def _prefix(self, n: int):
        """Of the first ``n`` stored tokens: (tokens kept raw, tokens merged, their rows' order as stored -- raw then
        merged -- for token order: an index array, or None where it is the identity). Memoized per ``n`` and runs
        version (a decode step asks for the same prefix until the next merge: no walk over the runs a step)."""
        key = (n, self.__dict__.get("_runs_version", 0))
        memo = self.__dict__.get("_prefix_memo")
        if memo is not None and memo[0] == key:
            return memo[1]
        nr = nm = 0
        spans = []
        for flag, rows in self.runs:
            take = min(rows, n - nr - nm)
            if take <= 0:
                break
            spans.append((flag, nr if flag else nm, take))
            nr, nm = (nr + take, nm) if flag else (nr, nm + take)
        order = None
        if not (all(f for f, _, _ in spans[:-1]) or all(not f for f, _, _ in spans)):  # else raw first: as stored
            order = mx.array(np.concatenate([np.arange(a, a + c) + (0 if f else nr) for f, a, c in spans]).astype(
                np.int32))
        self._prefix_memo = (key, (nr, nm, order))
        return nr, nm, order

    def _runs_changed(self) -> None:
        self._runs_version = self.__dict__.get("_runs_version", 0) + 1

    def _decode(self, kind: str, n: int, dtype=mx.float32) -> mx.array:
        """Restored rows [B, H, n, D] of the first ``n`` compressed tokens, in token order."""
        nr, nm, order = self._prefix(n)
        parts = [getattr(self, f"raw_{kind}")[:, :, :nr].astype(dtype)] if nr else []
        if nm:
            parts.append(self._merged_rows(kind, nm, dtype))
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        return x if order is None else mx.take(x, order, axis=2)

    def _merged_rows(self, kind: str, n: int, dtype) -> mx.array:
        """Restored rows [B, H, n, D] of the first ``n`` merged tokens (in their stored order)."""
        if self.mc_role == "primary":
            return (getattr(self, f"pn_{kind}")[:, :, :n].astype(dtype)
                    * getattr(self, f"dir_{kind}")[:, :, :n].astype(dtype))
        d = getattr(self.primary, f"dir_{kind}")[:, :, :n].astype(dtype)
        x = getattr(self, f"mn_{kind}")[:, :, :n].astype(dtype) * d
        r = getattr(self, f"n_retained_{kind}")
        if r:
            # rows retained at positions >= n go to a trash row past the end: no host sync to count them
            B, H, _, D = x.shape
            flat = mx.concatenate([x.transpose(2, 0, 1, 3).reshape(-1, D), mx.zeros((1, D), dtype)])
            idx = mx.minimum(getattr(self, f"idx_{kind}")[:r], n * B * H)
            flat[idx] = getattr(self, f"ret_{kind}")[:r].astype(dtype)
            x = flat[:-1].reshape(n, B, H, D).transpose(1, 2, 0, 3)
        return x

    # -- the CPU decode step: raw rows read in place by native joint_finish, merged ones as softmax partials

    def _cpu_kernel_ready(self, mask, d: int, dv: int, rep: int) -> bool:
        """One query row, a string/None mask, the native module built, head dims and query heads it takes."""
        return (native.available() and self.attend_path in ("auto", "dequant") and isinstance(mask, (str, type(None)))
                and max(d, dv) <= 256 and rep <= 32)

    def _attend_cpu(self, queries, call, *, scale, sinks):
        """A decode step: the raw rows, the window and the call's row joined with the merged tokens' partials
        (``_merged_partials``) in native ``joint_finish``; checked once per process against ``_attend_codes``."""
        q0, _, past_k, past_v, new_k, new_v = call
        qf = scaled_rows(queries, new_k.shape[1], scale)
        nr, nm, _ = self._prefix(q0)
        B, H, R, _ = qf.shape
        part = self._merged_partials(qf, nm) if nm else Partials.empty(B, H, R, new_v.shape[-1])
        raw = (self.raw_k[:, :, :nr], self.raw_v[:, :, :nr]) if nr else None
        groups = [g for g in (raw, (past_k, past_v), (new_k, new_v)) if g is not None and g[0] is not None]
        return finish_partials(queries, qf, part, groups, sinks)

    def _merged_partials(self, qf, n: int) -> Partials:
        """Online-softmax partials of the scaled grouped queries ``qf`` [B, H, R, D] over the first ``n`` merged
        tokens, on the shared direction: scores ``g · (q · d)`` (``g`` the layer's magnitude), the merge layer's
        retained rows' scores set to ``q · row`` and their values corrected by ``row - g · d``."""
        merge = self.mc_role == "merge"
        src = self.primary if merge else self
        B, H, R, D = qf.shape
        dk, dv = (getattr(src, f"dir_{k}")[:, :, :n].astype(mx.float32) for k in "kv")
        gk, gv = (getattr(self, f"{'mn' if merge else 'pn'}_{k}")[:, :, :n, 0].astype(mx.float32) for k in "kv")
        s = (qf @ dk.swapaxes(-1, -2)) * gk[:, :, None, :]
        fix_k = merge and self.n_retained_k
        if fix_k:  # scores of retained keys: q . row (positions past n go to a trash slot)
            pos, bh, valid = self._retained_slots("k", n, R)
            rows = self.ret_k[: self.n_retained_k].astype(mx.float32)
            sr = (qf.reshape(B * H, R, D)[bh] @ rows[:, :, None])[..., 0]  # [r, R]
            flat = mx.concatenate([s.reshape(-1), mx.zeros((1,))])
            flat[pos] = sr
            s = flat[:-1].reshape(B, H, R, n)
        m = s.max(axis=-1)
        e = mx.exp(s - m[..., None])
        acc = (e * gv[:, :, None, :]) @ dv
        if merge and self.n_retained_v:  # retained values: + e · (row - g · d) per retained row
            pos, bh, valid = self._retained_slots("v", n, R)
            r = self.n_retained_v
            idx = self.idx_v[:r]
            t = mx.minimum(idx // (B * H), n - 1)
            flat_dv = dv.reshape(B * H, n, -1)
            corr = self.ret_v[:r].astype(mx.float32) - gv.reshape(B * H, n)[bh, t][:, None] * flat_dv[bh, t]
            w = mx.concatenate([e.reshape(-1), mx.zeros((1,))])[pos] * valid[:, None]  # [r, R]
            add = mx.zeros((B * H, R, dv.shape[-1])).at[bh].add(w[..., None] * corr[:, None, :])
            acc = acc + add.reshape(B, H, R, -1)
        return Partials(m, e.sum(axis=-1), acc)

    def _retained_slots(self, kind: str, n: int, R: int):
        """A merge layer's retained rows of one side as slots of the [B·H, R, n] scores: (flat positions [r, R],
        trash slot ``B·H·R·n`` for rows past ``n``; their (batch, head) index [r]; valid [r])."""
        r = getattr(self, f"n_retained_{kind}")
        BH = self._heads
        idx = getattr(self, f"idx_{kind}")[:r]
        t, bh = idx // BH, idx % BH
        valid = t < n
        pos = (bh[:, None] * R + mx.arange(R)[None, :]) * n + t[:, None]
        return mx.where(valid[:, None], pos, BH * R * n), bh, valid

    def _check_trim_rows(self, n: int) -> None:
        """Only past the stored rows: not KIVI's rule (a trim may cut a block; rows merged with trimmed ones stay)."""
        self._check_stored(n, self.stored_rows())

    def _trim_rows(self, n: int) -> int:
        if n <= self.n_res:
            self.n_res -= n
            return n
        cut = n - self.n_res
        self.n_quant, self.n_res = self.n_quant - cut, 0
        while cut:  # the newest runs first
            flag, rows = self.runs[-1]
            take = min(rows, cut)
            if flag:
                self.n_raw -= take
            self.runs[-1][1] -= take
            if self.runs[-1][1] == 0:
                self.runs.pop()
            cut -= take
        self._runs_changed()
        if self.mc_role == "merge":
            BH = self._heads
            merged = self.n_quant - self.n_raw
            for kind in ("k", "v"):
                r = getattr(self, f"n_retained_{kind}")
                if r:  # retained positions are ascending: keep those below the new merged length
                    keep = int((getattr(self, f"idx_{kind}")[:r] < merged * BH).sum())
                    setattr(self, f"n_retained_{kind}", keep)
                    for name in ("ret", "idx"):
                        setattr(self, f"{name}_{kind}", getattr(self, f"{name}_{kind}")[:keep])
        return n

    def _compressed_bytes(self, kind, B, H, D):
        raw = B * H * self.n_raw * D * 2
        merged = self.n_quant - self.n_raw
        if self.mc_role == "primary":
            return raw + B * H * merged * (D + 1) * 2  # shared direction + magnitudes
        return raw + B * H * merged * 2 + getattr(self, f"n_retained_{kind}") * (D * 2 + 4)

    _heads = property(lambda self: self.res_k.shape[0] * self.res_k.shape[1])
    n_retained = property(lambda self: 0 if not self._slots else
                          self.n_retained_k + self.n_retained_v + 2 * self._heads * self.n_raw,
                          doc="Rows (batch, head, token; keys and values apart) a merge layer keeps exactly: "
                              "retained ones and those of blocks kept raw.")
    # a merge layer's compressed rows, keys and values: 2 · B · H · n_quant (0 for a primary)
    _slots = property(lambda self: 0 if self.res_k is None or self.mc_role != "merge"
                      else 2 * self._heads * self.n_quant)
    n_merged = property(lambda self: self._slots - self.n_retained if self._slots else 0,
                        doc="Rows (as in ``n_retained``) restored as magnitude · shared SLERP direction.")
    retention_rate = property(lambda self: self.n_retained / self._slots if self._slots else 0.0,
                              doc="n_retained / (n_retained + n_merged) of a merge layer (0.0 for a primary).")


def block_rows(sel: np.ndarray) -> np.ndarray:
    """Row indices (int32) of the blocks ``sel`` marks, blocks of ``BLOCK`` rows."""
    return (np.flatnonzero(sel)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1).astype(np.int32)
