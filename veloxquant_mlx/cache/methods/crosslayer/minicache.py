"""MiniCache (Liu, Liu, Pan, He, Haffari, Zhuang, "MiniCache: KV Cache Compression in Depth
Dimension for Large Language Models", arXiv 2405.14366).

Paper: from the middle of the network on, the KV states of adjacent layers point in similar
directions. Each pair of adjacent layers (l-1, l) is merged token by token: every state is split into
its magnitude ``||x||`` and direction ``x/||x||``; the two directions are interpolated on the sphere
(SLERP, ``e = sin((1-t)Ω)/sinΩ · e_{l-1} + sin(tΩ)/sinΩ · e_l``, Ω the angle between them) and stored
once for the pair, each layer keeps only its per-token magnitudes and restores ``x̂ = ||x|| · e``.
Token pairs whose directions differ too much to be merged are *retained* (kept exactly).

This implementation (``minicache_start_frac`` s, ``minicache_group_size`` g = 2,
``minicache_retention_threshold`` θ, ``minicache_slerp_t`` t):

* ``build_layers`` (one ``MiniCacheCoordinator`` per prompt cache): the first ``floor(s·L)`` full-KV
  layers and a trailing unpaired layer are lossless (role ``"primary"`` with no reader); from there,
  pairs of adjacent layers: the *primary* (lower) and the *merge* (upper) layer. mlx_lm runs the
  primary first in every forward pass.
* Both layers keep this call's rows and up to ``BLOCK``-1 earlier ones in a float16 window (the
  primary *publishes* its window to the coordinator: the merge layer reads it). When the merge layer
  has ``BLOCK`` (32) or more window rows it merges them in one vectorized step, separately for keys
  and values, per (batch, head, token): cosine c between the two layers' rows; tokens with
  ``c < θ`` are *retained*, the others *merged*.

  - shared direction ``dir [B, H, T, D]`` float16, held once (by the primary, counted once in its
    ``nbytes``): ``SLERP(e_primary, e_merge; t)`` for merged tokens, the primary's own row for
    retained tokens;
  - primary magnitudes ``pn [B, H, T, 1]`` float16 (``1`` for retained tokens): the primary restores
    ``pn · dir`` (exact float16 for retained tokens);
  - merge magnitudes ``mn [B, H, T, 1]`` float16: the merge layer restores ``mn · dir``, then overwrites
    its retained tokens with their exact float16 rows, held compactly (``ret [r, D]`` float16 plus their
    flat token-major positions ``idx [r]`` int32).

  θ = 1 retains every token (both layers exact in float16), θ = -1 merges every token. Bytes per token
  per KV head for the pair (keys or values, D = 64): 2·D + 4 (shared direction + two magnitudes) +
  retained fraction · (2·D + 4), vs 4·D for two float16 layers.
* ``update_and_fetch`` returns the stored rows (restored) + this call's rows as given (attended in
  full precision, stored merged afterwards, like KIVI's residual); ``attend`` is KIVI's dispatch-point
  attention with ``_keys_t``/``_values`` = the restored rows.
* Host syncs: one per merge step (the retained count, to size ``ret``), i.e. once per prefill chunk
  or once per ``BLOCK`` decode steps, never per decode step.

Deviations: the paper picks retained tokens with a *relative* angular-distance threshold (between the
min and max distance of the layer pair); here a fixed cosine threshold θ (the project's option). The
paper keeps retained tokens of both layers in a separate buffer; here the primary's retained rows live
in the shared-direction slot with magnitude 1 (no extra bytes). The project's brief describes the
primary as lossless; with a lossless primary plus a stored merged direction the pair would hold more
bytes than two float16 layers, so (as in the paper) the primary also restores merged tokens from the
shared direction. Only g = 2 (the paper's pairs) is supported. ``minicache_max_ctx`` is unused
(buffers grow). The newest < ``BLOCK`` tokens stay float16 in both layers. Trims keep every remaining
token's own per-token data (but tokens merged together with trimmed ones stay merged, where a cache
that never saw the trimmed tokens would hold them in float16: ``exact_trim = False``) and must be
applied to every layer alike (mlx_lm does). A cache built alone (``KVCacheFactory.create``) is a lossless primary.

Measured (veloxquant eval --task kld, SmolLM2-135M float32 on the CPU, 512-token essay context +
32 scored decode steps, merging from half depth, t = 0.5): adjacent SmolLM2 layers are nearly
orthogonal token by token (55% of the merge layers' rows have cosine < 0 with their primary), so the
default θ = 0.9 (and 0.99) retains every row: KL 0.0000, kv/fp16 1.064 (the magnitudes and retained
positions cost 6% over float16); θ = 0: KL 0.444, kv/fp16 0.962, 55% retained; θ = -1 (merge
everything): KL 0.845, kv/fp16 0.837. The paper's similarity premise does not hold on this model.
"""

from __future__ import annotations

import uuid

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import grow_rows
from ..quantization.kivi import RES_DTYPE, KIVIKVCache
from ..layer_links import registry, relink, relinking_state

BLOCK = 32  # window rows merged at once (one host sync per merge step)
_EPS = 1e-6

# primaries by "<uid>:<group>" (the most recently loaded one), to relink after load_prompt_cache
_LOADED = registry()


class MiniCacheCoordinator:
    """Links the layers of one prompt cache: primaries publish themselves (their float16 window and
    the shared direction they hold), merge layers fetch their primary by group id."""

    def __init__(self, uid: str | None = None):
        self.uid = uid or uuid.uuid4().hex
        self._primaries: dict[int, "MiniCacheKVCache"] = {}

    def publish(self, group_id: int, primary: "MiniCacheKVCache") -> None:
        self._primaries[group_id] = primary

    def fetch(self, group_id: int) -> "MiniCacheKVCache":
        p = self._primaries.get(group_id)
        if p is None:
            raise RuntimeError(f"MiniCache: no primary published for group {group_id}")
        return p


def slerp(a: mx.array, b: mx.array, t: float) -> mx.array:
    """Spherical interpolation between unit vectors a, b [..., D] (t = 0 → a, t = 1 → b)."""
    cos = mx.clip(mx.sum(a * b, axis=-1, keepdims=True), -1.0, 1.0)
    omega = mx.arccos(cos)
    so = mx.sin(omega)
    small = so < 1e-4
    safe = mx.where(small, 1.0, so)
    wa = mx.where(small, 1.0 - t, mx.sin((1.0 - t) * omega) / safe)
    wb = mx.where(small, t, mx.sin(t * omega) / safe)
    out = wa * a + wb * b
    return out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), _EPS)


def merge_pair(xp: mx.array, xm: mx.array, t: float, threshold: float):
    """Merge a block of rows [B, H, n, D] of the primary (xp) and the merge layer (xm).

    Returns (dir, pn, mn, retain): shared direction (primary's own row where retained), primary
    magnitude (1 where retained), merge magnitude, boolean retain mask [B, H, n]."""
    xp, xm = xp.astype(mx.float32), xm.astype(mx.float32)
    np_ = mx.linalg.norm(xp, axis=-1, keepdims=True)
    nm = mx.linalg.norm(xm, axis=-1, keepdims=True)
    ep, em = xp / mx.maximum(np_, _EPS), xm / mx.maximum(nm, _EPS)
    cos = mx.sum(ep * em, axis=-1)
    retain = cos < threshold
    d = mx.where(retain[..., None], xp, slerp(ep, em, t))
    pn = mx.where(retain[..., None], 1.0, np_)
    return d, pn, nm, retain


@register_with_mlx_lm
@register("minicache")
class MiniCacheKVCache(KIVIKVCache):
    """MiniCache cross-layer merging for one layer (role "primary" or "merge"; see the module doc)."""
    chunk_invariant = True  # whole 32-row blocks at absolute positions, merged token by token
    # returns n, but rows merged together with the trimmed ones stay merged (lossy) instead of
    # float16
    exact_trim = False
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
        self.mc_role, self.mc_group = role, int(group_id)
        self.coordinator = coordinator
        self.mc_uid = coordinator.uid if coordinator is not None else ""
        # a primary without coordinator (built alone) has no reader: lossless
        self.mc_readers = int(n_readers) if (coordinator is not None and role == "primary") else 0
        if role == "merge" and coordinator is None:
            raise QuantizerConfigError("coordinator", None, "a MiniCacheCoordinator for role='merge'")
        if role == "primary" and coordinator is not None:
            coordinator.publish(self.mc_group, self)
        self.n_retained_k = self.n_retained_v = 0

    def _init_layout(self):
        g = self.config.options.group_size  # validation checked the types and ranges
        if g != 2:
            raise QuantizerConfigError("minicache_group_size", g, "2 (pairs of adjacent layers)")
        self.group, self.qbits = BLOCK, 16
        self._call = None

    dequant_only = "merged cross-layer codes"

    def _key_words(self) -> int:  # KIVI's attend reads it; no codes here
        return 0

    @classmethod
    def build_layers(cls, layer_configs):
        """Lossless layers below ``floor(start_frac · L)``, then (primary, merge) pairs; a trailing
        unpaired layer is a lossless primary. One coordinator per call (= per prompt cache)."""
        L = len(layer_configs)
        if not L:
            return []
        coord = MiniCacheCoordinator()
        start = int(layer_configs[0].options.start_frac * L)
        out = []
        for i, cfg in enumerate(layer_configs):
            j = i - start
            if j < 0:
                out.append(cls(cfg, "primary", group_id=i, coordinator=coord, n_readers=0))
            elif j % 2 == 0:
                readers = 1 if i + 1 < L else 0
                out.append(cls(cfg, "primary", group_id=i, coordinator=coord, n_readers=readers))
            else:
                out.append(cls(cfg, "merge", group_id=i - 1, coordinator=coord))
        return out

    # ---------------------------------------------------------------- documented properties
    @property
    def role(self) -> str:
        return self.mc_role

    @property
    def group_id(self) -> int:
        return self.mc_group

    @property
    def primary(self) -> "MiniCacheKVCache":
        return self.coordinator.fetch(self.mc_group)

    # ---------------------------------------------------------------- state (relink on load)
    def _relink_loaded(self):
        primary = self.mc_role == "primary"
        self.coordinator = relink(_LOADED, f"{self.mc_uid}:{self.mc_group}", primary,
                                  lambda: MiniCacheCoordinator(self.mc_uid), "MiniCacheKVCache: the primary")
        if primary:
            self.coordinator.publish(self.mc_group, self)

    state = relinking_state(lambda cache: cache._relink_loaded())

    # ---------------------------------------------------------------- storage
    def _store(self, keys, values):
        self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
        q0, r0, N = self.n_quant, self.n_res, keys.shape[2]
        past_k = self.res_k[:, :, :r0] if r0 else None
        past_v = self.res_v[:, :, :r0] if r0 else None
        self._call = (q0, r0, past_k, past_v, keys, values)
        self.res_k = grow_rows(self.res_k, r0, keys.astype(RES_DTYPE))
        self.res_v = grow_rows(self.res_v, r0, values.astype(RES_DTYPE))
        self.n_res = r0 + N
        m = (self.n_res // BLOCK) * BLOCK
        if not m:
            return
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

    def _append_primary(self, kind, d, pn):
        t0 = self.n_quant
        setattr(self, f"dir_{kind}", grow_rows(getattr(self, f"dir_{kind}"), t0, d.astype(RES_DTYPE)))
        setattr(self, f"pn_{kind}", grow_rows(getattr(self, f"pn_{kind}"), t0, pn.astype(RES_DTYPE)))

    def _advance(self, m):
        """Move the window past its first ``m`` (now merged) rows."""
        rest = self.n_res - m
        for kind in ("k", "v"):
            buf = getattr(self, f"res_{kind}")
            keep = buf[:, :, m : self.n_res] if rest else buf[:, :, :0]
            setattr(self, f"res_{kind}", grow_rows(None, 0, keep) if rest else
                    mx.zeros((*buf.shape[:2], BLOCK, buf.shape[-1]), RES_DTYPE))
        self.n_quant += m
        self.n_res = rest

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
                rows = xm.transpose(2, 0, 1, 3).reshape(-1, D)[order]
                idx = order + t0 * B * H
                old_r, old_i = getattr(self, f"ret_{kind}"), getattr(self, f"idx_{kind}")
                setattr(self, f"ret_{kind}", rows if old_r is None else mx.concatenate([old_r, rows]))
                setattr(self, f"idx_{kind}", idx if old_i is None else mx.concatenate([old_i, idx]))
            setattr(self, f"n_retained_{kind}", getattr(self, f"n_retained_{kind}") + r)
        p._advance(m)
        self._advance(m)

    # ---------------------------------------------------------------- restoring the stored form
    def _restore(self, kind: str, n: int, dtype=mx.float32) -> mx.array:
        """Restored rows [B, H, n, D] of the first ``n`` merged tokens."""
        if self.mc_role == "primary":
            return (getattr(self, f"pn_{kind}")[:, :, :n].astype(dtype)
                    * getattr(self, f"dir_{kind}")[:, :, :n].astype(dtype))
        d = getattr(self.primary, f"dir_{kind}")[:, :, :n].astype(dtype)
        x = getattr(self, f"mn_{kind}")[:, :, :n].astype(dtype) * d
        r = getattr(self, f"n_retained_{kind}")
        if r:
            # rows retained at positions >= n (merged later than the rows asked for) go to a trash
            # row past the end: no host sync to count them
            B, H, _, D = x.shape
            flat = mx.concatenate([x.transpose(2, 0, 1, 3).reshape(-1, D), mx.zeros((1, D), dtype)])
            idx = mx.minimum(getattr(self, f"idx_{kind}")[:r], n * B * H)
            flat[idx] = getattr(self, f"ret_{kind}")[:r].astype(dtype)
            x = flat[:-1].reshape(n, B, H, D).transpose(1, 2, 0, 3)
        return x

    def _keys_t(self, n, dtype=mx.float32):
        return self._restore("k", n, dtype).swapaxes(-1, -2)

    def _values(self, n, dtype=mx.float32):
        return self._restore("v", n, dtype)

    # ---------------------------------------------------------------- trim (exact)
    def _trim_rows(self, n: int) -> int:
        self._call = None
        if n > self.stored_rows():
            raise ValueError(f"cannot trim {n} tokens: only {self.stored_rows()} are stored")
        if n <= self.n_res:
            self.n_res -= n
            return n
        self.n_quant -= n - self.n_res
        self.n_res = 0
        if self.mc_role == "merge":
            BH = self.mn_k.shape[0] * self.mn_k.shape[1]
            for kind in ("k", "v"):
                r = getattr(self, f"n_retained_{kind}")
                if r:  # retained positions are ascending: keep those below the new length
                    keep = int((getattr(self, f"idx_{kind}")[:r] < self.n_quant * BH).sum())
                    setattr(self, f"n_retained_{kind}", keep)
                    setattr(self, f"ret_{kind}", getattr(self, f"ret_{kind}")[:keep])
                    setattr(self, f"idx_{kind}", getattr(self, f"idx_{kind}")[:keep])
        return n

    # ---------------------------------------------------------------- accounting
    def _part_bytes(self, kind: str) -> int:
        """Bytes of the filled part of one side (keys or values), window included."""
        res = getattr(self, f"res_{kind}")
        if res is None:
            return 0
        B, H, _, D = res.shape
        win = B * H * self.n_res * D * 2
        if self.mc_role == "primary":
            return win + B * H * self.n_quant * (D + 1) * 2  # shared direction + magnitudes
        r = getattr(self, f"n_retained_{kind}")
        return win + B * H * self.n_quant * 2 + r * (D * 2 + 4)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the filled parts of the arrays held (spare buffer capacity left out)."""
        return self._part_bytes("k") + self._part_bytes("v")

    @property
    def compressed_key_bytes(self) -> int:
        """Stored key bytes: magnitudes + retained float16 rows (merge) or the shared direction
        (held and counted by the primary) + the float16 window."""
        return self._part_bytes("k")

    @property
    def compressed_value_bytes(self) -> int:
        return self._part_bytes("v")

    def _fp16(self, kind):
        res = getattr(self, f"res_{kind}")
        return 0 if res is None else res.shape[0] * res.shape[1] * self.offset * res.shape[-1] * 2

    @property
    def fp16_key_bytes(self) -> int:
        return self._fp16("k")

    @property
    def fp16_value_bytes(self) -> int:
        return self._fp16("v")

    @property
    def n_retained(self) -> int:
        """Rows (batch, head, token; keys and values counted separately) this merge layer keeps
        exactly instead of merging (0 for a primary: it holds the shared direction)."""
        return self.n_retained_k + self.n_retained_v

    def _slots(self) -> int:
        """Merged-step rows, keys and values: 2 · B · H · n_quant."""
        if self.res_k is None:
            return 0
        return 2 * self.res_k.shape[0] * self.res_k.shape[1] * self.n_quant

    @property
    def n_merged(self) -> int:
        """Rows (as in ``n_retained``) restored as magnitude · shared SLERP direction."""
        return self._slots() - self.n_retained if self.mc_role == "merge" else 0

    @property
    def retention_rate(self) -> float:
        """n_retained / (n_retained + n_merged) of a merge layer (0.0 for a primary)."""
        s = self._slots()
        return self.n_retained / s if (s and self.mc_role == "merge") else 0.0
