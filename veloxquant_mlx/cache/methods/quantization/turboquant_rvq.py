"""TurboQuant-RVQ: random rotation + two-stage residual vector quantization of keys *and* values,
with float16 sink rows and a float16 window of the newest tokens, in the mlx_lm cache protocol.
The library's default method (``KVCacheConfig().method``).

Paper: A. Zandieh, M. Daliri, M. Hadian, V. Mirrokni, "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", arXiv 2504.19874. TurboQuant normalises a vector, multiplies it by a
random rotation ``Pi`` so that every coordinate of the resulting unit vector follows the same known
(Beta-type, ~N(0, 1/d)) distribution whatever the input, and can therefore quantize it with a
*data-oblivious* codebook computed once for that distribution; its MSE distortion per unit vector at
``b`` bits per coordinate is within a small constant (<= sqrt(3)*pi/2 ~ 2.72) of the
information-theoretic lower bound ``4^-b``. The paper's quantizer is scalar (one Lloyd-Max codebook
per coordinate, plus a 1-bit QJL stage on the residual for unbiased inner products); this method
keeps the rotation and the data-oblivious codebooks and replaces the quantizer by a two-stage
residual vector quantizer on sub-vectors.

Algorithm (per KV head; keys with ``(s, B) = (key_sub_dim, key_codebook_bits)``, values with
``(value_sub_dim, value_codebook_bits)``; ``d`` the head dimension, ``S = d / s`` sub-vectors):

1. ``g = ||x||`` (stored as float16) and ``y = Pi (x / g)``, ``Pi`` a seeded Haar-random orthogonal
   ``d x d`` matrix (``primitives.rotation.random_orthogonal(d, config.seed)``; one matrix per head
   dimension, shared by keys, values, heads and layers).
2. ``y`` is cut into ``S`` sub-vectors of ``s`` coordinates; each gets a ``B``-bit code of a two-stage
   residual VQ (``primitives.rvq``): a stage-1 centroid ``c1[i]`` (``B1 = min(B, 8)`` bits) plus a
   cell-scaled stage-2 centroid ``sigma[i] * c2[j]`` (``B2 = B - B1`` bits; none when ``B <= 8``),
   encoded by a beam search over the 4 nearest stage-1 centroids.
3. Codebooks are data-oblivious: seeded k-means on sub-vectors of uniformly random unit vectors in R^d
   (exactly the distribution of ``y``) plus joint refinement; cached per process and, with
   ``config.store``, in that ``ArtifactStore`` (key ``tqrvq.d{d}.s{s}.b{B}.seed{seed}``).
4. Codes are bit-packed at their real width (``primitives.bitpack``: one plane per stage, rows padded
   to whole 32-bit words): a 12-bit code takes 12 bits.
5. New rows enter a float16 window (``window.ResidualWindowCache``). When it holds ``R + QUANT_BLOCK``
   rows (``R = residual_length``) its oldest rows beyond the newest ``R``, in whole ``QUANT_BLOCK``s,
   leave it in one block (the same rows however the stream was split into calls): the stream's first
   ``SINK_ROWS`` = 4 tokens go to float16 *sink* rows, all later ones are quantized.

Bits and bytes. Per quantized token and KV head: ``row_bytes(d, s, B)`` = packed code words + a
2-byte norm, for keys and for values. Defaults (``s_k=4, B_k=12, s_v=8, B_v=8``), ``d = 64``: keys
12/4 = 3 code bits per coordinate (8 + 4 bits per sub-vector) + 16/64 for the norm = 3.25 bits,
values 8/8 = 1 code bit (one 8-bit stage) + 0.25 = 1.25 bits: 26 + 10 = 36 bytes per token per KV
head instead of 256 at float16 (0.141x; SmolLM2-135M: 36 * 3 heads * 30 layers = 3240 bytes per
token instead of 23040). The window (R .. R + QUANT_BLOCK - 1 rows) and the 4 sink rows stay at 16
bits, so a whole cache tends to 0.141x only as the context grows: measured 0.282x at 1087 tokens
(the window is ~13% of the tokens there). ``bits_per_coordinate()`` and ``bytes_per_token()`` report
the figures of any configuration.

Measured on the embedded SmolLM2-135M (``bench_turboquant_rvq.py quality``: 1024-token essay prompt,
KL divergence of the next-token distribution vs the uncompressed cache over 64 decode steps; one
text, so differences below ~20% are within noise):

=====================================  =======  ===============  ===========
setting (key B/s, value B/s)           KLD      bytes/token      whole cache
=====================================  =======  ===============  ===========
defaults K12/4 V8/8 (2-bit class)      0.066    0.141x fp16      0.282x
K8/4 V16/8 (same bytes as defaults)    0.048    0.141x           0.280x
K10/4 V16/8                            0.029    0.156x           0.295x
K12/4 V12/8                            0.029    0.156x           0.302x
K16/4 V12/4                            0.0050   0.234x           0.368x
K16/4 V16/4                            0.0042   0.266x           0.393x
K10/2 V12/4                            0.0023   0.266x           0.396x
K10/2 V16/4 (4-bit class)              0.0012   0.297x           0.422x
=====================================  =======  ===============  ===========

"bytes/token": one quantized token (codes + norms) vs float16; "whole cache": ``nbytes`` of all 30
caches (window, sink rows, spare capacity and the constants included) vs mlx_lm's fp16 cache for the
same 1087 tokens -- at this length the float16 window (128-159 rows) is about half the bytes.
With a 4096-token prompt (prefilled in two chunks of 2048, the second seeing the first compressed):
defaults KLD 0.102 at 0.179x whole cache, K10/4 V16/8 0.042 at 0.194x, K10/2 V16/4 0.0010 at 0.332x.

Without the float16 sink rows the defaults measured 0.128 (the first tokens take a large share of
the attention, so their 1-bit value error is not averaged out); values, not keys, dominate the
error at the defaults (keys only quantized: 0.015; values only: 0.133, both without sinks); at
4-bit-class sizes keys matter most (K16/4 V16/4 vs K10/2 V12/4: same bytes, 0.0042 vs 0.0023).

Choices (measured, see ``STAGE2_STUDY`` and the benchmark script):

* Second stage: at the same 12 bits per 4 key coordinates, a second codebook (cell scales, beam
  encoding) gave KLD 0.013, an 8-bit VQ + 1-bit sign stage 0.016, an 8-bit VQ + QJL (48 signs + a
  float16 residual norm) 0.236 -- worse than no second stage at all (0.046): the QJL estimate is
  unbiased but its variance exceeds the residual's own contribution -- and the paper's scalar
  Lloyd-Max at 3 bits 0.012 (keys only quantized). The residual codebook is used.
* Split of B: MSE per unit vector (d = 64) of 12 bits on 4 coordinates: 8+4 0.0286, 6+6 0.0292
  (scalar Lloyd-Max at 3 bits 0.0334, bound 4^-3 = 0.0156); of 8 bits on 8 coordinates: one stage
  0.326, 6+2 0.338, 4+4 0.338. Hence ``B1 = min(B, 8)``: with ``B <= 8`` one stage is better.
  Cell scales and beam search lowered the 8+4 MSE from 0.0337 (plain greedy RVQ) to 0.0286.
* Rejected after measurement: a per-token least-squares gain instead of the norm (KLD 0.140 vs
  0.128 at the defaults, without sinks), centring keys or values on the first block's mean (0.218).

Deviations from the paper (all of them):

1. Vector instead of scalar quantization (two residual k-means stages on ``s``-dim sub-vectors,
   ``B / s`` bits per coordinate), with a beam-search encoder and cell-scaled second stage.
2. No QJL stage; the score estimate is biased like the paper's MSE variant (see the study above).
3. Norms are stored in float16 (the paper assumes exact norms); norms above 65504 saturate.
4. Keys and values are both quantized this way, with no outlier-channel split.
5. A float16 window of the newest ``R`` .. ``R + QUANT_BLOCK - 1`` tokens (KIVI-style residual) and
   the stream's first 4 tokens in float16 (attention sinks, as in StreamingLLM arXiv 2309.17453 /
   KIVI-sink); a call's own rows are attended in full precision, so a prompt processed in one chunk
   is attended exactly and only stored compressed. Rows that move from the window into codes during
   a call are still seen in float16 by that call; later prefill chunks see earlier ones compressed.
6. Codebooks come from k-means on samples (not the exact density) and are refined jointly; they are
   cached per process / in the artifact store. A saved prompt cache is decoded with the codebooks
   of the loading process (identical for the same seed on the same platform; an
   ``NpyDirectoryArtifactStore`` pins them across machines).

Storage and ``nbytes``: ``k_codes1``/``k_codes2`` (uint32 words, no stage-2 plane when ``B <= 8``) and
``k_norms`` (float16), the same for values, ``[B, H, capacity, .]`` with at most 1/32 + ``QUANT_BLOCK``
spare rows, plus ``ResidualWindowCache``'s float16 window and sink rows. ``nbytes`` is the sum of their
``.nbytes`` plus, for the first cache of each set of constants (``build_layers``, ``counts_constants``
in the state; a cache made alone owns its constants), the shared rotation and codebooks
(``constant_nbytes``, ~33 KB for d = 64 at the defaults); ``used_nbytes`` leaves spare capacity and
constants out. Trim drops window rows, then the newest codes, then sink rows: the remaining tokens keep
their stored form, but those the trimmed tokens pushed out of the window stay quantized
(``exact_trim`` False). ``merge`` builds the batch form (``turboquant_rvq_batch.py``). No Python loop
over tokens, heads or batch rows (long blocks are encoded in a few row chunks to bound memory), no
host synchronisation per decode step.

Speed (``bench_turboquant_rvq.py speed``; CPU, 2 cores, both caches timed alternately in the same
run, median of 5 rounds): decode runs at 0.62x (1k context) / 0.63x (4k) the tokens/s of mlx_lm's
plain ``KVCache`` on the tiny-ish shape (SmolLM2's attention shape, 8 layers) and 0.72x / 0.66x on
SmolLM2-135M. The quantized attention costs ~1.2 ms per layer at 1k tokens and ~2.9 ms at 4k
(LUT gather ~0.7 ms, value gather ~0.8 ms at 4k) against MLX's fused attention over float32 rows;
a fused kernel (GPU) would remove most of the gap, MLX's CPU backend has none for gathers.
"""


from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, unpack_bits
from ...primitives.buffers import grow_rows, reserve_rows
from ...primitives.rotation import random_orthogonal
from ...primitives.rvq import STAGE1_MAX_BITS, RVQCodebook, row_bytes, rvq_codebook, split_bits
from ...window import QUANT_BLOCK, SINK_ROWS, ResidualWindowCache  # noqa: F401 (SINK_ROWS re-exported)

__all__ = [
    "TurboQuantRVQKVCache",
    "RVQCodebook",
    "rvq_codebook",
    "split_bits",
    "row_bytes",
    "QUANT_BLOCK",
    "STAGE2_STUDY",
]

LUT_MAX_ROWS = 16  # query rows per KV head (rep * N) up to which quantized keys are scored by LUT
_FP16_MAX = 65504.0

#: Measured KL divergence (nats, mean over 64 decode steps after a 1024-token essay prompt,
#: SmolLM2-135M, R = 128, 4 sink rows, keys only quantized, values exact) of second-stage options
#: at 12 bits per 4 key coordinates (``scripts/bench_turboquant_rvq.py stage2``).
STAGE2_STUDY: dict = {
    "rvq_8+4_cell_scaled (used)": 0.0129,
    "vq8 + 1-bit sign stage": 0.0156,
    "vq8 + qjl 48 signs + fp16 residual norm": 0.2357,
    "scalar lloyd-max 3 bits (paper's MSE quantizer)": 0.0116,
    "vq8 alone (8 bits / 4 coords)": 0.0462,
}



class _Quantizer:
    """Rotation + codebook for one head dimension (shared by every cache with the same parameters)."""

    def __init__(self, dim, sub_dim, bits, seed, store):
        self.dim, self.sub_dim, self.bits = dim, sub_dim, bits
        self.rot_t = _rotation(dim, seed)  # y = x @ rot_t (= Pi x); x = y @ rot_t.T
        self.cb = rvq_codebook(dim, sub_dim, bits, seed, store)

    def arrays(self) -> list[mx.array]:
        return [self.rot_t, *self.cb.arrays()]

    def encode(self, x: mx.array):
        """``x [B, H, n, d]`` -> (packed stage-1 codes, packed stage-2 codes or None, float16 norms)."""
        xf = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(xf * xf, axis=-1))
        y = (xf / mx.maximum(norm, 1e-30)[..., None]) @ self.rot_t
        i, j = self.cb.encode(y)
        p1 = pack_bits(i, self.cb.bits1)
        p2 = pack_bits(j, self.cb.bits2) if j is not None else None
        return p1, p2, mx.minimum(norm, _FP16_MAX).astype(mx.float16)

    def codes(self, p1, p2):
        """Unpacked codes (uint8 ``[.., S]``) from packed planes."""
        return unpack_bits(p1, self.cb.bits1, self.cb.n_sub), (
            unpack_bits(p2, self.cb.bits2, self.cb.n_sub) if p2 is not None else None)

    def decode_rotated(self, p1, p2) -> mx.array:
        return self.cb.decode(*self.codes(p1, p2))


_QUANTIZERS: dict[tuple, _Quantizer] = {}
_ROTATIONS: dict[tuple, mx.array] = {}


def _rotation(dim: int, seed: int) -> mx.array:
    """``Pi^T`` for ``(dim, seed)``: one array per process, shared by keys, values and all layers."""
    r = _ROTATIONS.get((dim, seed))
    if r is None:
        r = _ROTATIONS[(dim, seed)] = mx.contiguous(random_orthogonal(dim, seed).T)
        mx.eval(r)
    return r


def _quantizer(dim, sub_dim, bits, seed, store) -> _Quantizer:
    key = (dim, sub_dim, bits, seed)
    q = _QUANTIZERS.get(key)
    if q is None:
        q = _QUANTIZERS[key] = _Quantizer(dim, sub_dim, bits, seed, store)
    elif store is not None:
        rvq_codebook(dim, sub_dim, bits, seed, store)  # make sure the store holds it too
    return q


# ---------------------------------------------------------------------------------------- the cache
@register_with_mlx_lm
@register("turboquant_rvq")
class TurboQuantRVQKVCache(ResidualWindowCache):
    """TurboQuant rotation + two-stage residual VQ of keys and values, float16 window, attention on
    the codes. See the module docstring."""
    chunk_invariant = True  # data-oblivious codebooks, per-token codes, window compacted in whole blocks
    exact_trim = False  # returns n, but rows the trimmed rows pushed out of the float16 window stay quantized
    batchable = True  # merge -> TurboQuantRVQBatchKVCache (turboquant_rvq_batch.py); subclasses keep raising

    array_fields = ("k_codes1", "k_codes2", "k_norms", "v_codes1", "v_codes2", "v_norms", "win_k", "win_v",
                    "sink_k", "sink_v")
    scalar_fields = ("n_sink", "n_quant", "n_win", "dtype_name", "counts_constants")
    _shared = ("_kq", "_vq")

    def _init_layout(self):
        c, o = self.config, self.config.options
        self.residual_length = int(o.residual_length)
        self.key_sub_dim, self.value_sub_dim = int(o.key_sub_dim), int(o.value_sub_dim)
        self.key_bits, self.value_bits = int(o.key_codebook_bits), int(o.value_codebook_bits)
        self.seed = int(c.seed)
        for field, sub, bits in (("key", self.key_sub_dim, self.key_bits),
                                 ("value", self.value_sub_dim, self.value_bits)):
            if c.head_dim % sub:
                raise QuantizerConfigError(f"{field}_sub_dim", sub,
                                           f"a divisor of head_dim={c.head_dim}")
            if not 1 <= bits <= 2 * STAGE1_MAX_BITS:
                raise QuantizerConfigError(f"{field}_codebook_bits", bits, "an int in 1..16")
        self._kq = self._vq = None
        self._call = None
        used = []
        for name in TurboQuantRVQKVCache.array_fields:
            is_stage2 = name.endswith("codes2")
            bits = self.key_bits if name.startswith("k_") else self.value_bits
            if not is_stage2 or split_bits(bits)[1]:
                used.append(name)
        self.array_fields = tuple(used)  # no stage-2 planes when B <= 8

    # ---- constants (lazily, from the dims actually seen)
    def _quantizers(self, dk: int, dv: int):
        if self._kq is None or self._kq.dim != dk or self._vq.dim != dv:
            for field, sub, d in (("key", self.key_sub_dim, dk), ("value", self.value_sub_dim, dv)):
                if d % sub:
                    raise QuantizerConfigError(f"{field}_sub_dim", sub, f"a divisor of the head dimension {d}")
            store = self.config.store
            self._kq = _quantizer(dk, self.key_sub_dim, self.key_bits, self.seed, store)
            self._vq = _quantizer(dv, self.value_sub_dim, self.value_bits, self.seed, store)
        return self._kq, self._vq

    def _qs(self):
        _, dk, dv = self._shape
        return self._quantizers(dk, dv)

    # ---- quantized storage
    def _store(self, keys, values):
        self._quantizers(keys.shape[-1], values.shape[-1])  # constants (and dim checks) up front
        super()._store(keys, values)

    def _append_quantized(self, keys, values):
        kq, vq = self._quantizers(keys.shape[-1], values.shape[-1])
        t0 = self.n_quant
        for prefix, qz, x in (("k_", kq, keys), ("v_", vq, values)):
            p1, p2, norms = qz.encode(x)
            for name, rows in (("codes1", p1), ("codes2", p2), ("norms", norms)):
                if rows is not None:
                    buf = reserve_rows(getattr(self, prefix + name), t0, rows, QUANT_BLOCK)
                    setattr(self, prefix + name, grow_rows(buf, t0, rows))

    def _planes(self, prefix: str, n: int):
        p1 = getattr(self, prefix + "codes1")[:, :, :n]
        p2 = getattr(self, prefix + "codes2", None)
        return p1, (p2[:, :, :n] if p2 is not None else None)

    def _quantized_dense(self, n):
        kq, vq = self._qs()
        out = []
        for prefix, qz in (("k_", kq), ("v_", vq)):
            rows = qz.decode_rotated(*self._planes(prefix, n)) @ qz.rot_t.T
            out.append(rows * getattr(self, prefix + "norms")[:, :, :n].astype(mx.float32)[..., None])
        return out[0], out[1]

    def _quantized_part(self, q, n):
        kq, vq = self._qs()
        B, H, R, D = q.shape
        qr = q @ kq.rot_t  # rotate the (scaled) queries once
        k_norms = self.k_norms[:, :, :n].astype(mx.float32)[:, :, None, :]
        if R <= LUT_MAX_ROWS:
            scores = self._lut_scores(kq, qr, *kq.codes(*self._planes("k_", n)))
        else:  # prefill-sized call: decode the codes once (rotated domain) and use one matmul
            scores = qr @ kq.decode_rotated(*self._planes("k_", n)).swapaxes(-1, -2)
        scores = scores * k_norms
        v_rot = vq.decode_rotated(*self._planes("v_", n))  # [B, H, n, Dv] rotated-domain centroids
        v_norms = self.v_norms[:, :, :n].astype(mx.float32)[:, :, None, :]

        def value_fn(p):  # sum_t p_t * gv_t * centroid[code_t] in the rotated domain, rotated back once
            return ((p * v_norms) @ v_rot) @ vq.rot_t.T

        return scores, value_fn

    def _quantized_tiles(self, q, ranges):
        """Prefill tiles: codes decoded to rotated-domain rows per tile, one matmul each; queries rotated
        once per call."""
        kq, vq = self._qs()
        qr = q @ kq.rot_t

        def rows(prefix, qz, a, b):
            p1, p2 = self._planes(prefix, b)
            return qz.decode_rotated(p1[:, :, a:], p2[:, :, a:] if p2 is not None else None)

        def norms(prefix, a, b):
            return getattr(self, prefix + "norms")[:, :, a:b].astype(mx.float32)[:, :, None, :]

        return [(lambda a=a, b=b: (qr @ rows("k_", kq, a, b).swapaxes(-1, -2)) * norms("k_", a, b),
                 lambda p, a=a, b=b: ((p * norms("v_", a, b)) @ rows("v_", vq, a, b)) @ vq.rot_t.T)
                for a, b in ranges]

    @staticmethod
    def _lut_scores(qz: _Quantizer, qr: mx.array, i: mx.array, j: Optional[mx.array]) -> mx.array:
        """sum_s LUT[s, code_ts] for rotated queries ``qr`` [B, H, R, D] and codes [B, H, T, S]."""
        cb = qz.cb
        B, H, R, _ = qr.shape
        T, S = i.shape[2], cb.n_sub
        table, joint = cb.lut(qr.reshape(B, H, R, S, cb.sub_dim), T)
        offs = mx.arange(S, dtype=mx.int32)

        def gather(tab, idx, width):  # tab [B, H, R, S*width], idx [B, H, T, S] -> [B, H, R, T, S]
            flat = (idx.astype(mx.int32) + offs * width).reshape(B, H, 1, T * S)
            return mx.take_along_axis(tab, mx.broadcast_to(flat, (B, H, R, T * S)), axis=-1).reshape(B, H, R, T, S)

        if joint:
            idx = i if j is None else i.astype(mx.int32) * cb.k2 + j.astype(mx.int32)
            return gather(table, idx, cb.k1 * cb.k2).sum(axis=-1)
        t1, t2 = table
        sig = mx.take(cb.sigma, i.astype(mx.int32))[:, :, None]  # [B, H, 1, T, S]
        return (gather(t1, i, cb.k1) + sig * gather(t2, j, cb.k2)).sum(axis=-1)

    # ---- accounting
    @staticmethod
    def constants_key(c):
        """What the shared rotation and codebooks depend on: head dim, sub-vector dims, bits, seed."""
        o = c.options
        return (c.head_dim, o.key_sub_dim, o.value_sub_dim, o.key_codebook_bits, o.value_codebook_bits, c.seed)

    @property
    def constant_nbytes(self) -> int:
        """Bytes of the rotation matrices and codebooks this cache uses (shared, see the docstring)."""
        if self._kq is None:
            if not getattr(self, "_shape", None):
                return 0  # nothing stored yet: the constants are not built
            self._qs()  # e.g. a cache restored from a state
        unique = {id(a): a for a in self._kq.arrays() + self._vq.arrays()}
        return sum(a.nbytes for a in unique.values())

    @property
    def nbytes(self) -> int:
        return super().nbytes + (self.constant_nbytes if self.counts_constants else 0)

    def bytes_per_token(self, head_dim: Optional[int] = None, value_dim: Optional[int] = None) -> int:
        """Theoretical bytes of one quantized token per KV head (codes + norms of K and V)."""
        d, dv = self._dims(head_dim, value_dim)
        return (row_bytes(d, self.key_sub_dim, self.key_bits)
                + row_bytes(dv, self.value_sub_dim, self.value_bits))

    def bits_per_coordinate(self, head_dim: Optional[int] = None,
                            value_dim: Optional[int] = None) -> tuple[float, float]:
        """(key, value) bits per coordinate of a quantized token, norms included."""
        d, dv = self._dims(head_dim, value_dim)
        return (8 * row_bytes(d, self.key_sub_dim, self.key_bits) / d,
                8 * row_bytes(dv, self.value_sub_dim, self.value_bits) / dv)

    @classmethod
    def _merge_batch(cls, caches):
        from .turboquant_rvq_batch import TurboQuantRVQBatchKVCache

        return TurboQuantRVQBatchKVCache.from_caches(caches)
