"""xKV (Chang, Lin, Akhauri, Lin, Wu, Ceze, Abdelfattah, "xKV: Cross-Layer SVD for KV-Cache Compression", arXiv
2503.18893): adjacent layers' dominant singular vectors align even when their caches differ token by token, so a
group of g layers is concatenated along the features, ``[X_1 … X_g] ≈ U·[V_1 … V_g]`` (one truncated SVD), U
stored once. Here, per KV head, keys and values apart, each layer of a group of ``xkv_group_size`` keeps its newest
rows in a float16 window (``GroupWindow``); the last concatenates the windows' whole ``xkv_group_quant_size`` (G)
blocks, fits the projection ``P [B, H, g·D, r]`` once (r = ``xkv_rank``, else the smallest keeping
``xkv_energy_threshold`` of the energy in every head) and quantizes the latents ``Z = X_group · P`` per channel over
G tokens (``xkv_latent_bits`` b) into the first layer (the owner); layer l restores ``Z · P_lᵀ``. Bytes per token
per KV head: ``r·b/8 + 4·r/G`` vs ``2·g·D`` for g float16 layers, plus ``2·g·D·r`` for P.

Measured (``veloxquant eval --task kld``, SmolLM2-135M float32, CPU, 512-token essay + 32 decode steps, 4-bit
latents; KL, kv/fp16 with projections): pairs at energy 0.95 (default) 0.191, 0.342; pairs rank 64: 0.173, 0.333;
groups of 4 rank 96: 0.259, 0.361; per-layer SVD rank 40 / 32 / 24: 0.246, 0.328 / 0.344, 0.274 / 0.472, 0.221;
on synthetic layers sharing a 12-dim subspace, rank 16 shared has relative error 5e-5 vs 0.17 for per-layer rank 8
(tests/test_crosslayer.py).

Deviations: P is fitted on the group's first complete block and later tokens (decode too) are projected onto it
(the paper: the whole prefill, decode uncompressed); latents are quantized (the paper: float16 factors); per KV
head, not over a layer's heads; attention is KIVI's on the restored rows, except a CPU decode step: ``(q P_l)·Zᵀ``
and ``(p Z) P_lᵀ`` on the latents in one pass (``native/latent_cpu.cpp``, ``_cpu_part``); ``xkv_max_ctx``
unused; trims are exact only for window rows plus whole latent groups, not into the block P was fitted on (else
``ValueError``; emptying the latents refits P) and must hit every layer alike; a cache built alone is a group of
one; a group's layers need equal head dims.
"""

from __future__ import annotations

import uuid

import mlx.core as mx

from ... import native
from ...base import register
from ...contract import register_with_mlx_lm
from ...primitives import blocks
from ...primitives import groupquant as gq
from ...primitives import lowrank_fit as lr
from ...primitives.buffers import grow_columns
from ...window import Partials
from ..layer_links import GroupWindow, relink, relinking_state
from ..quantization.kivi import RES_DTYPE, KIVIKVCache


class XKVGroup:
    """The layers of one group (in order); ``members[0]`` owns the shared arrays."""

    def __init__(self, size: int, uid: str | None = None):
        self.uid, self.size, self.members = uid or uuid.uuid4().hex, size, [None] * size


@register_with_mlx_lm
@register("xkv")
class XKVKVCache(GroupWindow, KIVIKVCache):
    """xKV: the layers of a group share one low-rank token basis (quantized latents)."""
    chunk_invariant, exact_trim = False, False  # basis fit on the first block; raises past a group
    array_fields = ("res_k", "res_v", "proj_k", "proj_v", "zk_codes", "zk_scales", "zk_biases",
                    "zv_codes", "zv_scales", "zv_biases")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "xk_uid", "xk_index", "xk_size", "rank_k", "rank_v",
                     "calib_end")
    attend_path = "dequant"
    xk_uid, xk_index, xk_size = "", 0, 1
    rank_k = rank_v = 0
    calib_end = 0  # (the owner's) encoded tokens the projection was fitted on (0: none fitted)
    calib_field = "calib_end"  # emptied latents: the group refits its projections (their rank goes with them)
    refit_fields = ("proj_k", "proj_v", "zk_codes", "zk_scales", "zk_biases", "zv_codes", "zv_scales", "zv_biases",
                    "rank_k", "rank_v")
    cut_group_text = ("{cls}: trimming {n} tokens would cut into a {G}-token latent group; exact trims drop the {res} "
                      "window tokens plus whole groups (n - {res} a multiple of {G})")

    def __init__(self, config, group: XKVGroup | None = None, index: int = 0):
        super().__init__(config)
        self.group_obj = group = group or XKVGroup(1)
        self.xk_uid, self.xk_index, self.xk_size = group.uid, int(index), group.size
        group.members[index] = self

    def _init_layout(self):
        o = self.config.options
        self.group, self.qbits = o.group_quant_size, o.latent_bits  # G: the window length

    dequant_only = "cross-layer latent codes"

    @classmethod
    def build_layers(cls, layer_configs):
        out, grp = [], None
        for i, cfg in enumerate(layer_configs):
            g = cfg.options.group_size
            if i % g == 0:
                grp = XKVGroup(min(g, len(layer_configs) - i))
            out.append(cls(cfg, grp, i % g))
        return out

    owner = property(lambda self: self.group_obj.members[0], doc="The layer holding the group's shared arrays.")
    _fit_holder = owner

    def _relink_loaded(self):
        self.group_obj = relink(self.xk_uid, self.xk_index == 0,
                                lambda: XKVGroup(self.xk_size, self.xk_uid), "XKVKVCache: the first layer")
        self.group_obj.members[self.xk_index] = self

    state = relinking_state()

    def _store(self, keys, values):
        m = self._append_window(keys, values)
        if m and self.xk_index == self.xk_size - 1:  # the last layer of the group compresses
            members = self.group_obj.members
            for c in members:
                if c is None or (c.n_quant, c.n_res) != (self.n_quant, self.n_res):
                    raise RuntimeError("XKVKVCache: the layers of a group must be fed the same tokens in "
                                       "order (first layer first)")
            self._compress(members, m)
        blocks.settle_prefill(keys.shape[2], self._group_arrays)

    def _group_arrays(self) -> list:
        """The group's arrays (the owner's latents, every member's window): what a prefill call waits for before this
        layer's attention is queued (``blocks.settle_prefill``; left to the chunk's end, every layer's rows and fit
        temporaries were alive together: SmolLM2, 1023 tokens in one chunk, 1.23x the plain cache's peak)."""
        return [a for c in self.group_obj.members if c is not None for a in c.held_arrays()]

    def _compress(self, members, m):
        own, o = members[0], self.config.options
        for kind in ("k", "v"):
            x = mx.concatenate([getattr(l, f"res_{kind}")[:, :, :m] for l in members], axis=-1).astype(mx.float32)
            if getattr(own, f"proj_{kind}") is None:  # fit once (first block)
                basis, energy, _ = lr.fit_basis(x)
                r = min(int(o.rank if o.rank is not None else lr.energy_rank(energy, o.energy_threshold)), x.shape[-1])
                setattr(own, f"proj_{kind}", basis[..., :r].astype(RES_DTYPE))
                setattr(own, f"rank_{kind}", r)
                own.calib_end = own.n_quant + m
            z = x @ getattr(own, f"proj_{kind}").astype(mx.float32)  # [B, H, m, r]
            q = gq.quantize_per_channel(z, self.qbits, self.group)  # codes [B, H, r, (m/G)*w]
            g0, w = own.n_quant // self.group, self._key_words()
            cap = g0 + max(m // self.group, 1 + g0 // 8)  # amortised growth
            for attr, arr, per in ((f"z{kind}_codes", q.codes, w), (f"z{kind}_scales", q.scales, 1),
                                   (f"z{kind}_biases", q.biases, 1)):
                setattr(own, attr, grow_columns(getattr(own, attr), g0 * per, arr, cap * per))
        for l in members:
            l._advance(m)

    def _latents_t(self, kind: str, n: int, dtype=mx.float32) -> mx.array:
        """Dequantized shared latents Zᵀ [B, H, r, n] of the first n tokens (n a multiple of G)."""
        own, g, w = self.owner, n // self.group, self._key_words()
        return gq.dequantize(getattr(own, f"z{kind}_codes")[..., : g * w], getattr(own, f"z{kind}_scales")[..., :g],
                             getattr(own, f"z{kind}_biases")[..., :g], self.qbits, self.group, dtype)

    def _proj(self, kind: str, dtype=mx.float32) -> mx.array:
        """This layer's block P_l [B, H, D, r] of the group's projection."""
        d = getattr(self, f"res_{kind}").shape[-1]
        return getattr(self.owner, f"proj_{kind}")[:, :, self.xk_index * d : (self.xk_index + 1) * d].astype(dtype)

    def _keys_t(self, n, dtype=mx.float32):
        return self._proj("k", dtype) @ self._latents_t("k", n, dtype)

    def _values(self, n, dtype=mx.float32):
        return (self._proj("v", dtype) @ self._latents_t("v", n, dtype)).swapaxes(-1, -2)

    def _cpu_layout(self) -> bool:
        return self.owner.proj_k is not None  # ``_cpu_part``: the latent kernel over the owner's latents

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Latents the CPU kernel reads (KIVI's key layout: ``channel_major``): 1-8-bit codes, token groups dividing
        64, ranks up to 256, up to 32 query heads a KV head."""
        own = self.owner
        return (native.available() and 1 <= self.qbits <= 8 and 64 % self.group == 0 and rep <= 32
                and max(own.rank_k, own.rank_v) <= 256)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` tokens' partials for scaled float32 queries ``qf`` [B, H, M, D]: ``(q P_l)·z`` on each
        block's decoded latents, the values' ``sum p z`` turned back once (``@ P_lᵀ``)."""
        own, b = self.owner, self.qbits
        m, l, acc = native.module().latent_decode(  # noqa: E741
            qf @ self._proj("k"), None, n, self.group, own.zk_codes, own.zk_scales, own.zk_biases, None,
            [b] * own.rank_k, own.zv_codes, own.zv_scales, own.zv_biases, None, v_bits=[b] * own.rank_v,
            channel_major=True)
        return Partials(m, l, acc @ self._proj("v").swapaxes(-1, -2))

    def _compressed_bytes(self, kind, B, H, D):
        p = getattr(self, f"proj_{kind}")
        if self.xk_index or p is None:
            return 0
        return p.nbytes + B * H * p.shape[-1] * (self.n_quant // self.group) * (4 * self._key_words() + 2 * 2)

    rank = property(lambda self: self.owner.rank_k)
