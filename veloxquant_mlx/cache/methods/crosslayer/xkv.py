"""xKV (Chang, Lin, Akhauri, Lin, Wu, Ceze, Abdelfattah, "xKV: Cross-Layer SVD for KV-Cache
Compression", arXiv 2503.18893).

Paper: the dominant singular vectors of adjacent layers' KV caches are well aligned even when the
caches themselves are not similar token by token. So the caches of a group of g adjacent layers are
concatenated along the feature axis, ``X_group = [X_1 … X_g]`` (tokens × g·D), and one truncated SVD
gives a shared token basis: ``X_group ≈ U·[V_1 … V_g]`` — the token-side factor U (tokens × r) is
stored once for the group, each layer keeps its own small ``V_l`` (r × D) and reconstructs
``X_l ≈ U·V_l``. At the same total storage this beats a separate SVD per layer whenever the layers'
subspaces are correlated.

This implementation (``xkv_group_size`` g, ``xkv_rank`` r or ``xkv_energy_threshold`` e,
``xkv_latent_bits`` b, ``xkv_group_quant_size`` G), keys and values separately, per KV head:

* ``build_layers`` (one group object per group per prompt cache): groups of g consecutive full-KV
  layers (a shorter last group is fine; a group of one is per-layer SVD). The first layer of a group
  (the *owner*) holds the group's shared arrays; every layer keeps its newest tokens in a float16
  window.
* Prefill / fit: layers arrive in order within a forward pass, so the *last* layer of a group is the
  first to see every layer's rows of the same tokens. When its window holds >= G rows, it
  concatenates the group's windows ``[B, H, m, g·D]`` (m = whole multiples of G) and, the first time,
  fits the projection: the principal directions of those rows (eigenvectors of the Gram matrix =
  right singular vectors, ``primitives.lowrank_fit.fit_basis``), rank r (``xkv_rank``, else the
  smallest rank that keeps e of the energy in every head). The projection ``P [B, H, g·D, r]``
  (float16, once per group) is fixed from then on; ``P_l`` is its block of rows for layer l.
* Storage: the shared latents ``Z = X_group · P`` (the ``U·Σ`` factor, tokens × r) quantized per
  latent channel over groups of G tokens (b-bit codes, float16 scale/bias per (channel, G tokens),
  KIVI's key layout, ``primitives.groupquant``), appended block by block; the layers' windows then
  drop those rows. Layer l restores ``X_l ≈ Z · P_lᵀ`` (its ``_keys_t`` is ``P_l · Zᵀ``). Earlier layers
  of the group read the shared latents on their *next* call (their own rows of this call are in
  their window and attended in full precision), so no layer ever reads latents that are not there.
* Decode tokens: the window fills up to G tokens (float16), then the last layer projects the block
  with the fixed P: one vectorized step per G decode steps, no host sync per step (one at fit time,
  for the energy rank).
* Bytes per token per KV head for the group (keys or values): ``r·b/8 + 4·r/G`` (latents + float16
  scale/bias), vs ``2·g·D`` for g float16 layers; plus the fixed ``2·g·D·r`` bytes of P per head. All
  held (and counted in ``nbytes``) once, by the owner; the other layers count only their windows.
* ``update_and_fetch`` returns the restored rows + this call's rows as given; ``attend`` is KIVI's
  dispatch-point attention with ``_keys_t``/``_values`` = the restored rows.

Measured (veloxquant eval --task kld, SmolLM2-135M float32 on the CPU, 512-token essay context +
32 scored decode steps; kv/fp16 = bytes held / float16 cache, projections included):

=============================================  =====  =======
xkv                                            KL     kv/fp16
=============================================  =====  =======
pairs, energy 0.95 (default), 4-bit latents    0.191  0.342
pairs, rank 64, 4-bit                          0.173  0.333
group of 1 (per-layer SVD), rank 40, 4-bit     0.246  0.328
group of 1, rank 32 (same latent bytes)        0.344  0.274
groups of 4, rank 96, 4-bit                    0.259  0.361
group of 1, rank 24 (same latent bytes)        0.472  0.221
=============================================  =====  =======

The shared basis beats per-layer SVD at about the same bytes (0.173 vs 0.246) on this model, whose
adjacent layers are *not* similar token by token (see minicache.py): the aligned subspaces are what
xKV exploits. On synthetic layers sharing a 12-dim token subspace, rank 16 shared reconstructs with
relative error 5e-5 vs 0.17 for per-layer rank 8 (tests/test_crosslayer.py).

Deviations: the paper fits on the whole prefill and leaves decode tokens uncompressed; here the
projection is fitted on the first block the group completes (the first prefill chunk, or G decode
tokens) and later tokens are projected onto it. The paper keeps the factors in float16; here the
latents are quantized (the project's option b). Per KV head rather than over all heads of a layer.
``xkv_max_ctx`` is unused (buffers grow). Trims are exact only when they drop window rows plus whole
G-token latent groups (else ``ValueError``), and must be applied to every layer alike (mlx_lm does).
A cache built alone (``KVCacheFactory.create``) is a group of one (per-layer SVD). Attention goes through
KIVI's dispatch-point attend over the restored rows ``P_l·Zᵀ`` (not reassociated as ``(q·P_l)·Zᵀ`` on
the latent side). The layers of a group must have equal head dims (every model here does).
"""

from __future__ import annotations

import uuid

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.buffers import grow_rows
from ...primitives import groupquant as gq
from ...primitives import lowrank_fit as lr
from ..quantization.kivi import RES_DTYPE, KIVIKVCache
from ..layer_links import registry, relink, relinking_state
from ...primitives.buffers import grow_columns

_LOADED = registry()


class XKVGroup:
    """The layers of one group (in order); ``members[0]`` owns the shared arrays."""

    def __init__(self, size: int, uid: str | None = None):
        self.uid = uid or uuid.uuid4().hex
        self.size = size
        self.members: list = [None] * size


@register_with_mlx_lm
@register("xkv")
class XKVKVCache(KIVIKVCache):
    """xKV: the layers of a group share one low-rank token basis (quantized latents)."""
    chunk_invariant = False  # shared projection and rank fitted on the first block the group completes
    exact_trim = False  # raises ValueError when the trimmed rows completed a latent group

    array_fields = ("res_k", "res_v", "proj_k", "proj_v", "zk_codes", "zk_scales", "zk_biases",
                    "zv_codes", "zv_scales", "zv_biases")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "xk_uid", "xk_index", "xk_size", "rank_k", "rank_v")
    attend_path = "dequant"
    xk_uid, xk_index, xk_size = "", 0, 1
    rank_k = rank_v = 0

    def __init__(self, config, group: XKVGroup | None = None, index: int = 0):
        super().__init__(config)
        if group is None:
            group = XKVGroup(1)
        self.group_obj = group
        self.xk_uid, self.xk_index, self.xk_size = group.uid, int(index), group.size
        group.members[index] = self

    def _init_layout(self):
        o = self.config.options  # validation checked the types and ranges
        if not o.energy_threshold > 0.0:
            raise QuantizerConfigError("xkv_energy_threshold", o.energy_threshold, "a number in (0, 1]")
        self.group = o.group_quant_size  # G: token groups of the latents = the window length
        self.qbits = o.latent_bits
        self._call = None

    dequant_only = "cross-layer latent codes"

    @classmethod
    def build_layers(cls, layer_configs):
        out, grp = [], None
        L = len(layer_configs)
        for i, cfg in enumerate(layer_configs):
            g = cfg.options.group_size
            if i % g == 0:
                grp = XKVGroup(min(g, L - i))
            out.append(cls(cfg, grp, i % g))
        return out

    @property
    def owner(self) -> "XKVKVCache":
        return self.group_obj.members[0]

    # ---------------------------------------------------------------- state (relink on load)
    def _relink_loaded(self):
        self.group_obj = relink(_LOADED, self.xk_uid, self.xk_index == 0,
                                lambda: XKVGroup(self.xk_size, self.xk_uid), "XKVKVCache: the first layer")
        self.group_obj.members[self.xk_index] = self

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
        m = (self.n_res // self.group) * self.group
        if m and self.xk_index == self.xk_size - 1:  # the last layer of the group compresses
            members = self.group_obj.members
            for c in members:
                if c is None or (c.n_quant, c.n_res) != (self.n_quant, self.n_res):
                    raise RuntimeError("XKVKVCache: the layers of a group must be fed the same tokens in "
                                       "order (first layer first)")
            self._compress(members, m)

    def _compress(self, members, m):
        own, o = members[0], self.config.options
        for kind in ("k", "v"):
            x = mx.concatenate([getattr(l, f"res_{kind}")[:, :, :m] for l in members], axis=-1)
            x = x.astype(mx.float32)  # [B, H, m, g*D]
            if getattr(own, f"proj_{kind}") is None:  # fit once (first block)
                basis, energy, _ = lr.fit_basis(x)
                r = o.rank if o.rank is not None else lr.energy_rank(energy, o.energy_threshold)
                r = min(int(r), x.shape[-1])
                setattr(own, f"proj_{kind}", basis[..., :r].astype(RES_DTYPE))
                setattr(own, f"rank_{kind}", r)
            p = getattr(own, f"proj_{kind}").astype(mx.float32)
            z = x @ p  # [B, H, m, r]
            q = gq.quantize_per_channel(z, self.qbits, self.group)  # codes [B, H, r, (m/G)*w]
            g0, w = own.n_quant // self.group, self._key_words()
            cap = g0 + max(m // self.group, 1 + g0 // 8)  # amortised growth
            for name, arr, per in (("codes", q.codes, w), ("scales", q.scales, 1), ("biases", q.biases, 1)):
                attr = f"z{kind}_{name}"
                setattr(own, attr, grow_columns(getattr(own, attr), g0 * per, arr, cap * per))
        for l in members:
            l._advance(m)

    def _advance(self, m):
        rest = self.n_res - m
        for kind in ("k", "v"):
            buf = getattr(self, f"res_{kind}")
            setattr(self, f"res_{kind}", grow_rows(None, 0, buf[:, :, m : self.n_res]) if rest else
                    mx.zeros((*buf.shape[:2], self.group, buf.shape[-1]), RES_DTYPE))
        self.n_quant += m
        self.n_res = rest

    # ---------------------------------------------------------------- restoring
    def _latents_t(self, kind: str, n: int, dtype=mx.float32) -> mx.array:
        """Dequantized shared latents Zᵀ [B, H, r, n] of the first n tokens (n a multiple of G)."""
        own, g, w = self.owner, n // self.group, self._key_words()
        return gq.dequantize(getattr(own, f"z{kind}_codes")[..., : g * w], getattr(own, f"z{kind}_scales")[..., :g],
                             getattr(own, f"z{kind}_biases")[..., :g], self.qbits, self.group, dtype)

    def _proj(self, kind: str, dtype=mx.float32) -> mx.array:
        """This layer's block P_l [B, H, D, r] of the group's projection."""
        d = getattr(self, f"res_{kind}").shape[-1]
        p = getattr(self.owner, f"proj_{kind}")
        return p[:, :, self.xk_index * d : (self.xk_index + 1) * d].astype(dtype)

    def _keys_t(self, n, dtype=mx.float32):
        return self._proj("k", dtype) @ self._latents_t("k", n, dtype)

    def _values(self, n, dtype=mx.float32):
        return (self._proj("v", dtype) @ self._latents_t("v", n, dtype)).swapaxes(-1, -2)

    # ---------------------------------------------------------------- trim
    def _trim_rows(self, n: int) -> int:
        self._call = None
        if n <= self.n_res:
            self.n_res -= n
            return n
        extra = n - self.n_res
        if extra % self.group:
            raise ValueError(
                f"XKVKVCache: trimming {n} tokens would cut into a {self.group}-token latent group; exact trims "
                f"drop the {self.n_res} window tokens plus whole groups (n - {self.n_res} a multiple of {self.group})")
        if extra > self.n_quant:
            raise ValueError(f"cannot trim {n} tokens: only {self.stored_rows()} are stored")
        self.n_quant -= extra
        self.n_res = 0
        return n

    # ---------------------------------------------------------------- accounting
    def _part_bytes(self, kind: str) -> int:
        res = getattr(self, f"res_{kind}")
        if res is None:
            return 0
        B, H, _, D = res.shape
        out = B * H * self.n_res * D * 2
        p = getattr(self, f"proj_{kind}")
        if self.xk_index == 0 and p is not None:
            r = p.shape[-1]
            groups = self.n_quant // self.group
            out += p.nbytes + B * H * r * groups * (4 * self._key_words() + 2 * 2)
        return out

    @property
    def used_nbytes(self) -> int:
        """Bytes of the filled parts (window, and for the owner the projection and latent groups)."""
        return self._part_bytes("k") + self._part_bytes("v")

    @property
    def compressed_key_bytes(self) -> int:
        return self._part_bytes("k")

    @property
    def compressed_value_bytes(self) -> int:
        return self._part_bytes("v")

    @property
    def rank(self) -> int:
        return self.owner.rank_k
