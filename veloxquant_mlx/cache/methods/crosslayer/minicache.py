"""MiniCache (Liu, Liu, Pan, He, Haffari, Zhuang, "MiniCache: KV Cache Compression in Depth Dimension for
Large Language Models", arXiv 2405.14366): from mid-depth on adjacent layers' KV states point alike, so a pair of
layers keeps per-token magnitudes per layer and one SLERP of the two directions; token pairs too far apart are
retained exactly. Here the first ``floor(minicache_start_frac · L)`` layers and an unpaired last one are lossless
primaries, then (primary, merge) pairs keep rows in a float16 window (``GroupWindow``) until the merge layer holds
``BLOCK`` rows and merges both windows (keys and values apart; cosine < ``minicache_retention_threshold``:
retained). The primary holds the shared direction (its own row where retained) and magnitudes ``pn`` (1 where
retained), the merge layer ``mn`` and its retained rows (``ret`` float16, token-major ``idx``): 2·D + 4 + retained
fraction · (2·D + 4) bytes per token and KV head for the pair, vs 4·D. One host sync per merge step.

Deviations: a fixed cosine threshold (the paper: relative angular distance); the primary restores merged tokens
from the shared direction, its retained rows there with magnitude 1 (a lossless primary plus a direction would
exceed two float16 layers); ``minicache_group_size`` must be 2; ``minicache_max_ctx`` unused; the newest <
``BLOCK`` tokens stay float16; tokens merged with trimmed ones stay merged, and trims must hit every layer alike;
a cache built alone is a lossless primary.

Measured (``veloxquant eval --task kld``, SmolLM2-135M float32, CPU, 512-token essay + 32 decode steps, t = 0.5):
55% of merge-layer rows have cosine < 0 with their primary, so θ = 0.9 (default) and 0.99 retain all (KL 0,
kv/fp16 1.064); θ = 0: KL 0.444, 0.962; θ = -1: 0.845, 0.837. The paper's premise fails on this model.
"""

from __future__ import annotations

import uuid
import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives import blocks
from ...primitives.buffers import grow_rows
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


@register_with_mlx_lm
@register("minicache")
class MiniCacheKVCache(GroupWindow, SideRows, KIVIKVCache):
    """MiniCache cross-layer merging for one layer (role "primary" or "merge"; see the module doc)."""
    chunk_invariant, exact_trim = True, False  # whole blocks; rows merged with trimmed ones stay
    trim_exact_or_raises = False
    array_fields = ("res_k", "res_v", "dir_k", "dir_v", "pn_k", "pn_v", "mn_k", "mn_v",
                    "ret_k", "idx_k", "ret_v", "idx_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "mc_role", "mc_group", "mc_uid", "mc_readers",
                     "n_retained_k", "n_retained_v")
    attend_path = "dequant"

    def __init__(self, config, role: str = "primary", group_id: int = 0, coordinator=None, n_readers: int = 1):
        if role not in ("primary", "merge"):
            raise QuantizerConfigError("role", role, "'primary' or 'merge'")
        super().__init__(config)
        self.mc_role, self.mc_group, self.coordinator = role, int(group_id), coordinator
        self.mc_uid = coordinator.uid if coordinator is not None else ""
        self.mc_readers = 0  # a primary built alone has no reader: lossless
        self.n_retained_k = self.n_retained_v = 0
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
        elif self.mc_readers == 0:  # no partner: lossless (direction = row, magnitude 1)
            for kind in ("k", "v"):
                rows = getattr(self, f"res_{kind}")[:, :, :m]
                self._append_primary(kind, rows, mx.ones((*rows.shape[:3], 1), RES_DTYPE))
            self._advance(m)
        # a paired primary waits for its merge layer, which merges both windows

    def _held_with_primary(self) -> list:
        """This layer's arrays and a merge layer's primary's (which it wrote): what a prefill call waits for before
        the layer's attention is queued (``blocks.settle_prefill``; left to the chunk's end, every layer's rows were
        alive together: SmolLM2, 1023 tokens in one chunk, 1.19x the plain cache's peak)."""
        held = self.held_arrays()
        return held + self.primary.held_arrays() if self.mc_role == "merge" else held

    def _append_primary(self, kind, d, pn):
        for name, new in ((f"dir_{kind}", d), (f"pn_{kind}", pn)):
            setattr(self, name, grow_rows(getattr(self, name), self.n_quant, new.astype(RES_DTYPE)))

    def _merge_block(self, p, m):
        o = self.config.options
        t0 = self.n_quant
        for kind in ("k", "v"):
            xp = getattr(p, f"res_{kind}")[:, :, :m]
            xm = getattr(self, f"res_{kind}")[:, :, :m]
            d, pn, mn, retain = merge_pair(xp, xm, float(o.slerp_t), float(o.retention_threshold))
            p._append_primary(kind, d, pn)
            setattr(self, f"mn_{kind}", grow_rows(getattr(self, f"mn_{kind}"), t0, mn.astype(RES_DTYPE)))
            # retained rows, compact, in token-major flat order: position (t0 + i) * B*H + (b*H + h)
            B, H, _, D = xm.shape
            flat_ret = retain.transpose(2, 0, 1).reshape(-1)  # [m*B*H]
            r = int(flat_ret.sum())  # the one host sync of a merge step
            if r:
                pos = mx.arange(flat_ret.size, dtype=mx.int32)
                order = mx.argsort(mx.where(flat_ret, pos, pos + flat_ret.size))[:r].astype(mx.int32)
                for name, new in (("ret", xm.transpose(2, 0, 1, 3).reshape(-1, D)[order]), ("idx", order + t0 * B * H)):
                    old = getattr(self, f"{name}_{kind}")
                    setattr(self, f"{name}_{kind}", new if old is None else mx.concatenate([old, new]))
            setattr(self, f"n_retained_{kind}", getattr(self, f"n_retained_{kind}") + r)
        p._advance(m)
        self._advance(m)

    def _decode(self, kind: str, n: int, dtype=mx.float32) -> mx.array:
        """Restored rows [B, H, n, D] of the first ``n`` merged tokens."""
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

    def _check_trim_rows(self, n: int) -> None:
        """Only past the stored rows: not KIVI's rule (a trim may cut a block; rows merged with trimmed ones stay)."""
        self._check_stored(n, self.stored_rows())

    def _trim_rows(self, n: int) -> int:
        if n <= self.n_res:
            self.n_res -= n
            return n
        self.n_quant, self.n_res = self.n_quant - (n - self.n_res), 0
        if self.mc_role == "merge":
            BH = self.mn_k.shape[0] * self.mn_k.shape[1]
            for kind in ("k", "v"):
                r = getattr(self, f"n_retained_{kind}")
                if r:  # retained positions are ascending: keep those below the new length
                    keep = int((getattr(self, f"idx_{kind}")[:r] < self.n_quant * BH).sum())
                    setattr(self, f"n_retained_{kind}", keep)
                    for name in ("ret", "idx"):
                        setattr(self, f"{name}_{kind}", getattr(self, f"{name}_{kind}")[:keep])
        return n

    def _compressed_bytes(self, kind, B, H, D):
        if self.mc_role == "primary":
            return B * H * self.n_quant * (D + 1) * 2  # shared direction + magnitudes
        return B * H * self.n_quant * 2 + getattr(self, f"n_retained_{kind}") * (D * 2 + 4)

    n_retained = property(lambda self: self.n_retained_k + self.n_retained_v,
                          doc="Rows (batch, head, token; keys and values apart) a merge layer keeps exactly.")
    # a merge layer's merged-step rows, keys and values: 2 · B · H · n_quant (0 for a primary)
    _slots = property(lambda self: 0 if self.res_k is None or self.mc_role != "merge"
                      else 2 * self.res_k.shape[0] * self.res_k.shape[1] * self.n_quant)
    n_merged = property(lambda self: self._slots - self.n_retained if self._slots else 0,
                        doc="Rows (as in ``n_retained``) restored as magnitude · shared SLERP direction.")
    retention_rate = property(lambda self: self.n_retained / self._slots if self._slots else 0.0,
                              doc="n_retained / (n_retained + n_merged) of a merge layer (0.0 for a primary).")
