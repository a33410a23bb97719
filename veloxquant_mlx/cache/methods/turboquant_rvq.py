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
2. ``y`` is cut into ``S`` sub-vectors of ``s`` coordinates; each gets a ``B``-bit code from a
   two-stage residual VQ: stage 1 picks one of ``K1 = 2^B1`` centroids ``c1`` (``B1 = min(B, 8)``),
   stage 2 one of ``K2 = 2^B2`` centroids ``c2`` for the residual (``B2 = B - B1``; no stage 2 when
   ``B <= 8``), and the reconstruction is ``c1[i] + sigma[i] * c2[j]``, where ``sigma[i]`` is a
   per-stage-1-cell scale stored in the codebook (cells of very different sizes share one stage-2
   codebook at no per-token cost).
3. Codebooks are data-oblivious: seeded k-means (``primitives.codebook.kmeans``) on sub-vectors of
   uniformly random unit vectors in R^d (exactly the distribution of ``y``), then a few rounds of
   joint refinement (re-encode; ``c1`` given ``c2``; ``c2`` given ``c1`` by weighted least squares;
   ``sigma`` by least squares). Encoding is a beam search: each of the 4 nearest stage-1 centroids is
   completed with its best stage-2 centroid and the best pair is kept. Codebooks are cached per
   process and, when ``config.store`` is given, in that ``ArtifactStore`` (key
   ``tqrvq.d{d}.s{s}.b{B}.seed{seed}``, one flat float32 array).
4. Codes are bit-packed at their real width with ``primitives.bitpack`` (a plane of B1-bit codes and
   a plane of B2-bit codes, each row padded to whole 32-bit words): a 12-bit code takes 12 bits.
   8- and 4-bit planes are read back by reinterpreting the words as bytes (same bit layout).
5. New rows enter a float16 window. When it holds ``R + QUANT_BLOCK`` rows (``R = residual_length``)
   its oldest rows beyond the newest ``R``, in whole ``QUANT_BLOCK``s, leave it in one vectorized
   block (so the rows quantized are the same however the stream was split into calls): the stream's
   first ``SINK_ROWS`` = 4 tokens go to a float16 *sink* buffer, all later ones are quantized.

Attention on the compressed form (``attend``, the dispatch point). The query is rotated once
(``q' = Pi q``, times the softmax scale). For decode-sized calls (``rep * N <= LUT_MAX_ROWS`` query
rows per KV head) a lookup table ``LUT[s, c] = <q'_s, centroid c>`` of shape ``[.., S, 2^B]`` is
built per query row (one joint table ``c1[i] + sigma[i] c2[j]`` when ``2^B <= JOINT_LUT_MAX`` and the
context is long enough to amortise it, else one table per stage) and gathered with the stored codes:
a quantized token's score is ``g_t * sum_s LUT[s, code_ts]``. Prefill chunks after the first
(``ResidualWindowCache._attend_chunk``) visit the stored rows in tiles with an online softmax
(``attention.online_softmax_attention``): each tile's codes are decoded to rotated-domain rows and
multiplied by the rotated queries, so no [N, T] float32 score matrix or [T, d] decoded past is built
(on a GPU: MLX's fused attention over the layer's decoded rows). Scores of the sink
rows, the quantized rows, the window rows and the call's own rows share one softmax (with the
model's attention-sink logit when it has one). The quantized rows' value output is computed in the
rotated domain, ``o' = sum_t p_t gv_t centroid[code_t]`` per sub-vector, and rotated back once
(``o = Pi^T o'``). On the CPU this sum gathers each stored code's centroid (a transient
``[T, d]`` float32 array in the rotated domain, no norms, no de-rotation) and contracts it with
``p * gv`` by one matmul: the literal histogram form (scatter-add ``p * gv`` into ``[.., S, 2^B]``,
then multiply by the codebook) computes the same sum but MLX's CPU scatter made it 7x slower
(``bench_turboquant_rvq.py ops``: 15 ms vs 2 ms for 4096 tokens). Keys are never decoded on the
decode path. ``update_and_fetch`` returns correct dense rows (lazily; MLX never computes them when
the dispatch point is installed).

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

Storage and ``nbytes``. Arrays held: ``k_codes1``/``k_codes2`` (uint32 words), ``k_norms`` (float16),
the same for values (no ``*_codes2`` plane when ``B <= 8``), all ``[B, H, capacity, .]``, appended in
place (``eviction.grow_rows``) after reserving at most 1/32 + ``QUANT_BLOCK`` spare rows; the window
``win_k``/``win_v`` ``[B, H, R + QUANT_BLOCK, d]`` and ``sink_k``/``sink_v`` ``[B, H, 4, d]`` in float16 (the
model's 16-bit dtype when it computes in 16 bits; ``config.dtype`` overrides). ``nbytes`` is the sum
of their ``.nbytes`` (spare capacity included: it is held) plus, for one cache per model, the
constants: the rotation and the codebooks are shared by every layer with the same head dimension,
and ``KVCacheBuilder.for_model`` builds the layers through ``build_layers``, which makes the first
cache of each set of constants their owner (``counts_constants``, kept in the state); a cache made
alone with ``KVCacheFactory.create`` owns its constants. ``used_nbytes`` leaves spare capacity and
constants out; ``constant_nbytes`` reports the constants (~33 KB for d = 64 at the defaults).

mlx_lm protocol: ``offset`` is the logical position; ``state`` holds the used rows of every array
and the configuration (``save_prompt_cache``/``load_prompt_cache`` round trip); deepcopy shares the
constants; ``trim(n)`` drops window rows, beyond the window the newest codes (then sink rows): each
remaining token keeps its own stored form, so the result is what a cache that never saw the trimmed
tokens would hold except that some of the newest remaining tokens may be quantized rather than
float16 -- those that the trimmed tokens pushed out of the window (so even a trim of window rows
only is not exact once a compaction ran since: ``exact_trim`` is False), or up to R of them after a
trim beyond the window; ``merge`` builds the batch form (``turboquant_rvq_batch.py``: each request
keeps its own sink rows, codes and window in mlx_lm's continuous batching). No Python loop
runs over tokens, heads or batch rows (long blocks are encoded in a few chunks of rows only to
bound the distance matrices' memory) and no decode step forces a host synchronisation.

Speed (``bench_turboquant_rvq.py speed``; CPU, 2 cores, both caches timed alternately in the same
run, median of 5 rounds): decode runs at 0.62x (1k context) / 0.63x (4k) the tokens/s of mlx_lm's
plain ``KVCache`` on the tiny-ish shape (SmolLM2's attention shape, 8 layers) and 0.72x / 0.66x on
SmolLM2-135M. The quantized attention costs ~1.2 ms per layer at 1k tokens and ~2.9 ms at 4k
(LUT gather ~0.7 ms, value gather ~0.8 ms at 4k) against MLX's fused attention over float32 rows;
a fused kernel (GPU) would remove most of the gap, MLX's CPU backend has none for gathers.
"""

from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

from ..attention import (bool_mask, dense_blocks, group_queries, online_softmax_attention, tile_ranges,
                         tile_rows, ungroup)
from ..base import register
from ..contract import CompressedKVCache, register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.buffers import grow_rows, reserve_rows
from ..primitives.bitpack import pack_bits, packed_words, unpack_bits
from ..primitives.codebook import kmeans, smallest_k
from ..primitives.rotation import random_orthogonal, seeded_rng

__all__ = [
    "TurboQuantRVQKVCache",
    "RVQCodebook",
    "rvq_codebook",
    "split_bits",
    "row_bytes",
    "QUANT_BLOCK",
    "STAGE2_STUDY",
]

# ---------------------------------------------------------------------------------------- tunables
STAGE1_MAX_BITS = 8  # stage-1 codebooks have at most 256 centroids (and codes fit bitpack's 8 bits)
BEAM = 4  # stage-1 candidates completed by stage 2 when encoding
KMEANS_ITERS = 20
REFINE_ITERS = 4  # joint refinement rounds of the two stages
SAMPLES_PER_CENTROID = 48  # training sub-vectors per stage-1 centroid
QUANT_BLOCK = 32  # the window is compacted when it holds R + QUANT_BLOCK rows
SINK_ROWS = 4  # the stream's first tokens stay in float16 (attention sinks, see the docstring)
LUT_MAX_ROWS = 16  # query rows per KV head (rep * N) up to which quantized keys are scored by LUT
JOINT_LUT_MAX = 4096  # largest 2^B for which one joint table [S, 2^B] is built per query row
JOINT_LUT_PER_TOKEN = 16  # ... and only when 2^B <= this * the number of quantized tokens
_ENCODE_CHUNK = 1 << 22  # distance-matrix entries per encoding block
_TAG_SAMPLES = 0x0A7E_0010
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


def split_bits(bits: int) -> tuple[int, int]:
    """(stage-1 bits, stage-2 bits) of a ``bits``-bit sub-vector code."""
    b1 = min(int(bits), STAGE1_MAX_BITS)
    return b1, int(bits) - b1


def row_bytes(dim: int, sub_dim: int, bits: int) -> int:
    """Stored bytes of one quantized vector: its packed code planes (whole 32-bit words each) and
    its float16 norm."""
    b1, b2 = split_bits(bits)
    n = dim // sub_dim
    return 4 * (packed_words(n, b1) + (packed_words(n, b2) if b2 else 0)) + 2


# ---------------------------------------------------------------------------------------- codebooks
class RVQCodebook:
    """A two-stage residual VQ codebook for ``sub_dim``-dimensional pieces of rotated unit vectors
    in R^``dim``: ``c1 [K1, s]``, cell scales ``sigma [K1]`` and ``c2 [K2, s]`` (None if one stage)."""

    def __init__(self, dim: int, sub_dim: int, bits: int, c1: mx.array, sigma: mx.array,
                 c2: Optional[mx.array]):
        self.dim, self.sub_dim, self.bits = int(dim), int(sub_dim), int(bits)
        self.bits1, self.bits2 = split_bits(bits)
        self.n_sub = self.dim // self.sub_dim
        self.c1, self.sigma, self.c2 = c1, sigma, c2
        self.k1, self.k2 = 1 << self.bits1, (1 << self.bits2) if self.bits2 else 1
        self.c1_sq = mx.sum(c1 * c1, axis=1)
        self.c2_sq = mx.sum(c2 * c2, axis=1) if c2 is not None else None
        # every reconstruction c1[i] + sigma[i] c2[j] at row i*K2 + j, when small enough: one gather
        # decodes a code and one matmul builds a query's joint lookup table
        self.joint = None
        if c2 is not None and self.k1 * self.k2 <= JOINT_LUT_MAX:
            self.joint = (c1[:, None] + sigma[:, None, None] * c2[None]).reshape(-1, self.sub_dim)
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.c1, self.sigma, self.c2, self.c1_sq, self.c2_sq, self.joint) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    # ---- serialisation (ArtifactStore): one flat float32 array
    def to_array(self) -> mx.array:
        parts = [self.c1.reshape(-1), self.sigma.reshape(-1)]
        if self.c2 is not None:
            parts.append(self.c2.reshape(-1))
        return mx.concatenate(parts)

    @classmethod
    def from_array(cls, a: mx.array, dim: int, sub_dim: int, bits: int) -> "RVQCodebook":
        b1, b2 = split_bits(bits)
        k1, k2 = 1 << b1, (1 << b2) if b2 else 0
        need = k1 * sub_dim + k1 + k2 * sub_dim
        a = mx.array(a).astype(mx.float32).reshape(-1)
        if a.size != need:
            raise ValueError(f"stored codebook has {a.size} values, expected {need}")
        c1 = a[: k1 * sub_dim].reshape(k1, sub_dim)
        sigma = a[k1 * sub_dim : k1 * sub_dim + k1]
        c2 = a[k1 * sub_dim + k1 :].reshape(k2, sub_dim) if k2 else None
        return cls(dim, sub_dim, bits, c1, sigma, c2)

    # ---- coding
    def encode(self, y: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """Codes ``(i [.., S], j [.., S] or None)`` (uint8) of rotated unit vectors ``y [.., dim]``."""
        lead = y.shape[:-1]
        x = y.astype(mx.float32).reshape(-1, self.sub_dim)
        m = x.shape[0]
        per_row = self.k1 + (min(BEAM, self.k1) * self.k2 if self.c2 is not None else 0)
        step = max(1, _ENCODE_CHUNK // per_row)
        if m <= step:
            i, j = self._encode_rows(x)
        else:  # bounded memory for long prefill blocks: a few blocks of rows, not a loop over tokens
            outs = [self._encode_rows(x[a : a + step]) for a in range(0, m, step)]
            i = mx.concatenate([o[0] for o in outs])
            j = mx.concatenate([o[1] for o in outs]) if self.c2 is not None else None
        shape = (*lead, self.n_sub)
        return i.reshape(shape), (j.reshape(shape) if j is not None else None)

    def _encode_rows(self, x: mx.array):
        d1 = self.c1_sq[None] - 2.0 * (x @ self.c1.T)  # [m, K1] (+||x||^2, constant per row)
        if self.c2 is None:
            return mx.argmin(d1, axis=1).astype(mx.uint8), None
        beam = min(BEAM, self.k1)
        cand = smallest_k(d1, beam).astype(mx.uint32) if beam < self.k1 else \
            mx.broadcast_to(mx.arange(self.k1, dtype=mx.uint32)[None], d1.shape)
        sig = self.sigma[cand][..., None]  # [m, beam, 1]
        r = (x[:, None] - self.c1[cand]) / sig  # residual in units of its cell's scale
        d2 = (mx.sum(r * r, axis=-1, keepdims=True) + self.c2_sq - 2.0 * (r @ self.c2.T)) * (sig * sig)
        best = mx.argmin(d2.reshape(x.shape[0], -1), axis=1)
        i = mx.take_along_axis(cand, (best // self.k2)[:, None].astype(mx.uint32), axis=1)[:, 0]
        return i.astype(mx.uint8), (best % self.k2).astype(mx.uint8)

    def decode(self, i: mx.array, j: Optional[mx.array]) -> mx.array:
        """Rotated-domain unit-vector reconstructions ``[.., dim]`` (float32) of codes ``[.., S]``."""
        ii = i.astype(mx.int32)
        if self.joint is not None and j is not None:
            out = mx.take(self.joint, ii * self.k2 + j.astype(mx.int32), axis=0)  # [.., S, s]
        else:
            out = mx.take(self.c1, ii, axis=0)
            if self.c2 is not None and j is not None:
                out = out + mx.take(self.sigma, ii)[..., None] * mx.take(self.c2, j.astype(mx.int32), axis=0)
        return out.reshape(*i.shape[:-1], self.dim)

    def lut(self, qs: mx.array, n_tokens: int):
        """Lookup tables of the query pieces ``qs [.., S, s]``: ``(table [.., S*K], joint)``.
        With ``joint`` the table is indexed by ``s*K + i*K2 + j`` (``K = K1*K2``), else it is the
        pair ``(stage-1 table [.., S*K1], stage-2 table [.., S*K2])``. The joint table (one gather per
        code instead of three) is built when ``K <= JOINT_LUT_MAX`` and not much larger than the
        number of tokens it will be gathered for."""
        lead = qs.shape[:-2]
        if self.c2 is None:
            return (qs @ self.c1.T).reshape(*lead, -1), True  # [.., S*K1]
        if self.joint is not None and self.k1 * self.k2 <= JOINT_LUT_PER_TOKEN * n_tokens:
            return (qs @ self.joint.T).reshape(*lead, -1), True  # [.., S*K1*K2]
        return ((qs @ self.c1.T).reshape(*lead, -1), (qs @ self.c2.T).reshape(*lead, -1)), False


def _train(dim: int, sub_dim: int, bits: int, seed: int) -> RVQCodebook:
    """k-means codebooks (+ joint refinement) on sub-vectors of uniform random unit vectors."""
    b1, b2 = split_bits(bits)
    k1, k2 = 1 << b1, 1 << b2
    n_sub = dim // sub_dim
    n_vec = -(-SAMPLES_PER_CENTROID * max(k1, k2 if b2 else 1) // n_sub)
    g = seeded_rng(_TAG_SAMPLES, seed).standard_normal((n_vec, dim))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    x = mx.array(g.reshape(-1, sub_dim).astype(np.float32))
    c1, labels = kmeans(x, k1, iters=KMEANS_ITERS, seed=seed)
    if not b2:
        return RVQCodebook(dim, sub_dim, bits, c1, mx.ones((k1,)), None)
    ar1, ar2 = mx.arange(k1), mx.arange(k2)

    def cell_sums(lab, vals, k, ar):  # per-cell sums of rows of vals (one-hot matmul), and counts
        oh = (lab[:, None] == ar[None]).astype(mx.float32)
        return oh.T @ vals, oh.sum(axis=0)

    r = x - c1[labels]
    ssum, cnt = cell_sums(labels, mx.sum(r * r, axis=1, keepdims=True), k1, ar1)
    sigma = mx.sqrt(ssum[:, 0] / mx.maximum(cnt, 1.0) / sub_dim)
    sigma = mx.where(sigma > 0, sigma, mx.mean(sigma) + 1e-6)
    c2, _ = kmeans(r / sigma[labels][:, None], k2, iters=KMEANS_ITERS, seed=seed + 1)
    cb = RVQCodebook(dim, sub_dim, bits, c1, sigma, c2)
    for _ in range(REFINE_ITERS):
        i, j = cb._encode_rows(x)
        i, j = i.astype(mx.int32), j.astype(mx.int32)
        s_i = sigma[i][:, None]
        # c1 given (c2, sigma): cell means of x - sigma c2
        num, cnt1 = cell_sums(i, x - s_i * c2[j], k1, ar1)
        c1 = mx.where(cnt1[:, None] > 0, num / mx.maximum(cnt1, 1.0)[:, None], c1)
        # c2 given (c1, sigma): weighted least squares, weights sigma^2
        r = x - c1[i]
        num, _ = cell_sums(j, r * s_i, k2, ar2)
        den, _ = cell_sums(j, s_i * s_i, k2, ar2)
        c2 = mx.where(den > 0, num / mx.maximum(den, 1e-20), c2)
        # sigma given (c1, c2): per-cell least squares scale
        num, _ = cell_sums(i, mx.sum(r * c2[j], axis=1, keepdims=True), k1, ar1)
        den, _ = cell_sums(i, mx.sum(c2[j] * c2[j], axis=1, keepdims=True), k1, ar1)
        new = num[:, 0] / mx.maximum(den[:, 0], 1e-20)
        sigma = mx.where((den[:, 0] > 0) & (mx.abs(new) > 1e-12), new, sigma)
        cb = RVQCodebook(dim, sub_dim, bits, c1, sigma, c2)
    return cb


_CODEBOOKS: dict[tuple, RVQCodebook] = {}


def rvq_codebook(dim: int, sub_dim: int, bits: int, seed: int, store=None) -> RVQCodebook:
    """The codebook for ``(dim, sub_dim, bits, seed)``: from this process's cache, else from
    ``store`` (an ``ArtifactStore``), else trained (and put in ``store``)."""
    key = (int(dim), int(sub_dim), int(bits), int(seed))
    name = f"tqrvq.d{dim}.s{sub_dim}.b{bits}.seed{seed}"
    cb = _CODEBOOKS.get(key)
    stored = store.get(name) if store is not None else None
    if cb is None and stored is not None:
        cb = RVQCodebook.from_array(stored, *key[:3])
    if cb is None:
        cb = _train(*key)
    _CODEBOOKS[key] = cb
    if store is not None and stored is None:
        store.put(name, cb.to_array())
    return cb


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


# ---------------------------------------------------------------------------------------- residual window
class _Call(NamedTuple):
    """What one ``update_and_fetch`` call attends over, in key order: ``s0`` float16 sink rows,
    ``q0`` quantized rows, the ``r0`` window rows stored before the call (``past_k``/``past_v``) and
    the call's own rows."""

    s0: int
    q0: int
    r0: int
    past_k: Optional[mx.array]
    past_v: Optional[mx.array]
    new_k: mx.array
    new_v: mx.array


def joint_attention(q, parts, mask, sinks, n_keys: int, out_dtype):
    """One softmax over several groups of keys.

    ``q`` [B, H, rep, N, D] (scaled, float32). ``parts``: list of ``(scores [B, H, rep*N, M_i],
    value_fn, cols)``: ``value_fn(p [B, H, rep*N, M_i])`` -> ``[B, H, rep*N, Dv]`` and ``cols`` the
    (start, stop) column ranges of the full key axis (``n_keys`` keys, mlx_lm order) that the part's
    ``M_i`` keys are, in order. The *last* part ends with the call's own ``N`` rows, the only keys a
    "causal" mask hides. ``mask``: mlx_lm's (None, "causal", boolean or additive array); ``sinks``
    [Hq] attention-sink logits or None. Returns [B, Hq, N, Dv]."""
    B, H, rep, N, _ = q.shape
    scores = [s.reshape(B, H, rep, N, s.shape[-1]) for s, _, _ in parts]
    if isinstance(mask, str):
        if N > 1:  # bottom-right aligned over the last part: its last N columns are the new rows
            m = scores[-1].shape[-1]
            allowed = mx.arange(m)[None] <= (m - N + mx.arange(N))[:, None]
            scores[-1] = mx.where(allowed, scores[-1], -mx.inf)
    elif mask is not None:
        full = bool_mask(mask, N, n_keys, H)
        for i, (_, _, cols) in enumerate(parts):
            pieces = [full[..., a:b] for a, b in cols if b > a]
            m = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
            scores[i] = mx.where(m, scores[i], -mx.inf)
    peak = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        peak = mx.maximum(peak, s.max(axis=-1, keepdims=True))
    sink = None
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, H, rep, 1, 1)
        peak = mx.maximum(peak, sink)
    probs = [mx.exp(s - peak) for s in scores]
    denom = probs[0].sum(axis=-1, keepdims=True)
    for p in probs[1:]:
        denom = denom + p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + mx.exp(sink - peak)
    out = None
    for p, (_, value_fn, _) in zip(probs, parts):
        o = value_fn(p.reshape(B, H, rep * N, p.shape[-1]))
        out = o if out is None else out + o
    out = out.reshape(B, H, rep, N, out.shape[-1]) / denom
    return ungroup(out).astype(out_dtype)


class ResidualWindowCache(CompressedKVCache):
    """Quantized blocks + a float16 window of the newest rows (+ float16 sink rows) + one softmax.

    Row order (= position order): ``n_sink`` float16 *sink* rows (the first ``SINK_ROWS`` tokens,
    never quantized), ``n_quant`` quantized rows, ``n_win`` float16 window rows. New rows enter the
    window; when it holds ``residual_length + quant_block`` rows, its oldest whole ``quant_block``s
    beyond ``residual_length`` leave it: the first ``SINK_ROWS`` tokens of the stream to the sink buffer,
    the others to the subclass's quantized storage (``_append_quantized``). ``update_and_fetch``
    returns the rows stored before the call in their stored form, then the call's rows as given;
    ``attend`` computes the same attention from the subclass's scores and values on the quantized
    form (``_quantized_part``), the exact float16 rows and the call's rows, with one softmax. A
    multi-row call (prefill chunk) over a stored past attends in tiles (``_attend_chunk``): transients
    bounded by a fraction of the dense score matrix. Subclasses implement ``_append_quantized``,
    ``_quantized_dense``, ``_quantized_part`` (decode-sized calls) and ``_quantized_tiles`` (chunks)."""

    window_fields = ("win_k", "win_v")
    sink_fields = ("sink_k", "sink_v")
    residual_length = 128
    quant_block = QUANT_BLOCK  # rows leave the window in whole blocks of this many
    n_sink = 0  # float16 sink rows (the stream's first tokens)
    n_quant = 0  # rows in quantized storage
    n_win = 0  # rows in the float16 window
    dtype_name = "float32"  # dtype of the rows last handed to the cache (dense outputs use it)
    _call: Optional[_Call] = None

    # ---- subclass hooks
    def _append_quantized(self, keys: mx.array, values: mx.array) -> None:
        """Quantize and store rows [B, H, n, D] after the ``n_quant`` stored ones."""
        raise NotImplementedError

    def _quantized_dense(self, n: int) -> tuple[mx.array, mx.array]:
        """Dense float32 (K, V) of the first ``n`` quantized rows."""
        raise NotImplementedError

    def _quantized_part(self, q: mx.array, n: int):
        """(scores [B, H, R, n], value_fn) of the first ``n`` quantized rows for scaled float32
        queries ``q`` [B, H, R, D] (R = rep * N); ``value_fn(p [B, H, R, n])`` -> [B, H, R, Dv]."""
        raise NotImplementedError

    # ---- storage
    def storage_dtype(self, compute_dtype):
        """Window/sink rows: float16 when computing in float32 (else the model's 16-bit dtype);
        ``config.dtype`` overrides."""
        if self.config.dtype is not None:
            return self.config.dtype
        return mx.float16 if compute_dtype == mx.float32 else compute_dtype

    def _store(self, keys, values):
        n = keys.shape[2]
        self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
        r0 = self.n_win
        past = (self.win_k[:, :, :r0], self.win_v[:, :, :r0]) if r0 else (None, None)
        self._call = _Call(self.n_sink, self.n_quant, r0, *past, keys, values)
        sd = self.storage_dtype(keys.dtype)
        self.win_k = grow_rows(self.win_k, r0, keys.astype(sd))
        self.win_v = grow_rows(self.win_v, r0, values.astype(sd))
        self.n_win = r0 + n
        block = self.quant_block
        if self.n_win >= self.residual_length + block:
            # whole blocks only: which rows are compacted then depends on the positions stored, not on
            # how the rows were split into calls (one prefill call or chunks + decode steps leave the
            # same rows quantized: ``chunk_invariant``)
            self._compact((self.n_win - self.residual_length) // block * block)

    def _compact(self, n: int) -> None:
        """Move the ``n`` oldest window rows out (sinks first, then codes); the rest start a window
        buffer of exactly ``residual_length + quant_block`` rows (it never holds more between calls)."""
        w = self.n_win
        k, v = self.win_k[:, :, :n], self.win_v[:, :, :n]
        s = min(SINK_ROWS - self.n_sink, n) if self.n_quant == 0 else 0
        if s > 0:  # a buffer of exactly SINK_ROWS rows
            if self.sink_k is None or self.sink_k.shape[2] < SINK_ROWS:
                kept = slice(0, self.n_sink if self.sink_k is not None else 0)
                self.sink_k = self._fresh(k, SINK_ROWS, (self.sink_k if self.sink_k is not None else k)[:, :, kept])
                self.sink_v = self._fresh(v, SINK_ROWS, (self.sink_v if self.sink_v is not None else v)[:, :, kept])
            # copies: a slice assignment that fills the whole buffer hands back its source, here a view
            # that would keep the whole (prompt-sized) window buffer alive behind 4 rows
            self.sink_k[:, :, self.n_sink : self.n_sink + s] = mx.contiguous(k[:, :, :s])
            self.sink_v[:, :, self.n_sink : self.n_sink + s] = mx.contiguous(v[:, :, :s])
            self.n_sink += s
        if n > s:
            self._append_quantized(k[:, :, s:], v[:, :, s:])
            self.n_quant += n - s
        cap = self.residual_length + self.quant_block
        self.win_k = self._fresh(self.win_k, cap, self.win_k[:, :, n:w])
        self.win_v = self._fresh(self.win_v, cap, self.win_v[:, :, n:w])
        self.n_win = w - n

    @staticmethod
    def _fresh(like: mx.array, capacity: int, rows: mx.array) -> mx.array:
        """A buffer of ``capacity`` rows shaped like ``like``, starting with ``rows``."""
        buf = mx.zeros((*like.shape[:2], capacity, like.shape[3]), dtype=like.dtype)
        if rows.shape[2]:
            buf[:, :, : rows.shape[2]] = rows
        return buf

    def _rows(self, s0, q0, past_k, past_v, new_k=None, new_v=None, dtype=mx.float32):
        ks, vs = [], []
        if s0:
            ks.append(self.sink_k[:, :, :s0])
            vs.append(self.sink_v[:, :, :s0])
        if q0:
            k, v = self._quantized_dense(q0)
            ks.append(k)
            vs.append(v)
        for k, v in ((past_k, past_v), (new_k, new_v)):
            if k is not None:
                ks.append(k)
                vs.append(v)
        if len(ks) == 1:
            return ks[0].astype(dtype), vs[0].astype(dtype)
        return (mx.concatenate([k.astype(dtype) for k in ks], axis=2),
                mx.concatenate([v.astype(dtype) for v in vs], axis=2))

    def _dense(self):
        r = self.n_win
        win = (self.win_k[:, :, :r], self.win_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_sink, self.n_quant, *win, dtype=getattr(mx, self.dtype_name))

    def update_and_fetch(self, keys, values):
        """Store the new rows; return the rows stored before this call (stored form) + the new rows."""
        self._check_input(keys, values)
        self._store(keys, values)
        self.offset += keys.shape[2]
        c = self._call
        return self._rows(c.s0, c.q0, c.past_k, c.past_v, c.new_k, c.new_v, dtype=keys.dtype)

    def stored_rows(self) -> int:
        return self.n_sink + self.n_quant + self.n_win

    # ---- attention
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        n = queries.shape[2]
        if call is None or call.new_k.shape[2] != n or keys.shape[2] != call.s0 + call.q0 + call.r0 + n:
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        mask = self._own_mask(mask, queries, keys)
        if call.s0 + call.q0 + call.r0 == 0:  # nothing stored before this call: exact attention
            return mx.fast.scaled_dot_product_attention(queries, call.new_k, call.new_v, scale=scale,
                                                        mask=mask, sinks=sinks)
        if n > 1:  # a prefill chunk over a stored past: bounded transients (``_attend_chunk``)
            return self._attend_chunk(queries, keys, values, call, scale=scale, mask=mask, sinks=sinks)
        B, Hq, N, D = queries.shape
        H = call.new_k.shape[1]
        rep = Hq // H
        q = group_queries(queries, H).astype(mx.float32) * scale  # [B, H, rep, N, D]
        qf = q.reshape(B, H, rep * N, D)

        # exact rows (float16 sinks + window, and the call's own rows) as one group, in key order
        s0, q0, r0 = call.s0, call.q0, call.r0
        ks, vs = [], []
        if s0:
            ks.append(self.sink_k[:, :, :s0])
            vs.append(self.sink_v[:, :, :s0])
        if r0:
            ks.append(call.past_k)
            vs.append(call.past_v)
        ks.append(call.new_k)
        vs.append(call.new_v)
        ek = mx.concatenate([k.astype(mx.float32) for k in ks], axis=2) if len(ks) > 1 else ks[0].astype(mx.float32)
        ev = mx.concatenate([v.astype(mx.float32) for v in vs], axis=2) if len(vs) > 1 else vs[0].astype(mx.float32)
        parts = []
        if q0:
            scores, value_fn = self._quantized_part(qf, q0)
            parts.append((scores, value_fn, ((s0, s0 + q0),)))
        parts.append((qf @ ek.swapaxes(-1, -2), lambda p: p @ ev, ((0, s0), (s0 + q0, keys.shape[2]))))
        return joint_attention(q, parts, mask, sinks, keys.shape[2], queries.dtype)

    def _attend_chunk(self, queries, keys, values, call: _Call, *, scale, mask, sinks):
        """Attention of a multi-row call (prefill chunk) over the stored past and its own rows, without
        any prompt-sized float32 array: on a GPU MLX's fused attention over the dense rows that
        ``update_and_fetch`` returned (one layer's past, decoded lazily in the model's dtype; no score
        matrix); elsewhere an online softmax over tiles of rows (``attention.online_softmax_attention``):
        the sinks, the quantized rows (``_quantized_tiles``) and the window plus the call's rows."""
        if mx.default_device().type == mx.DeviceType.gpu:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                        sinks=sinks)
        B, Hq, N, D = queries.shape
        H = call.new_k.shape[1]
        rep, M = Hq // H, keys.shape[2]
        qf = (group_queries(queries, H).astype(mx.float32) * scale).reshape(B, H, rep * N, D)
        tile = tile_rows(B * Hq * N, M, self.quant_block)
        s0, q0, r0 = call.s0, call.q0, call.r0
        blocks = []
        if s0:
            blocks += dense_blocks(qf, self.sink_k[:, :, :s0], self.sink_v[:, :, :s0], 0, tile)
        if q0:
            ranges = tile_ranges(0, q0, tile)
            blocks += [(s0 + a, s0 + b, sf, vf) for (a, b), (sf, vf) in zip(ranges, self._quantized_tiles(qf, ranges))]
        ek, ev = call.new_k, call.new_v
        if r0:
            ek = mx.concatenate([call.past_k.astype(ek.dtype), ek], axis=2)
            ev = mx.concatenate([call.past_v.astype(ev.dtype), ev], axis=2)
        blocks += dense_blocks(qf, ek, ev, s0 + q0, tile)
        return online_softmax_attention((B, H, rep, N), blocks, M, mask, sinks, queries.dtype)

    def _quantized_tiles(self, q: mx.array, ranges):
        """For scaled float32 queries ``q`` [B, H, R, D] and row ranges ``(a, b)`` of the quantized rows:
        one ``(scores_fn, values_fn)`` per range (``online_softmax_attention``'s block functions)."""
        raise NotImplementedError

    # ---- trim
    def _trim_rows(self, n: int) -> int:
        """Window rows are dropped exactly; beyond the window the newest codes, then sink rows."""
        self._call = None
        if n > self.stored_rows():
            raise ValueError(f"cannot trim {n} tokens: only {self.stored_rows()} rows are stored")
        w = min(n, self.n_win)
        q = min(n - w, self.n_quant)
        self.n_win -= w
        self.n_quant -= q
        self.n_sink -= n - w - q
        return n

    # ---- per-model constants
    counts_constants = True  # this cache's nbytes includes the process-wide constants it uses

    @staticmethod
    def constants_key(c):
        """The config fields a subclass's shared constants (rotations, codebooks) depend on; None: none."""
        return None

    @classmethod
    def build_layers(cls, configs):
        """One cache per layer config; the first cache of each distinct ``constants_key`` counts the
        shared constants in its ``nbytes``, the others do not (``KVCacheBuilder.for_model`` calls this)."""
        caches, seen = [], set()
        for c in configs:
            cache = cls(c)
            key = cls.constants_key(c)
            cache.counts_constants = key not in seen
            seen.add(key)
            caches.append(cache)
        return caches

    # ---- state: only the used rows are saved
    def _used(self, name: str) -> int:
        if name in self.window_fields:
            return self.n_win
        return self.n_sink if name in self.sink_fields else self.n_quant

    @property
    def state(self):
        out = CompressedKVCache.state.fget(self)
        for name in self.array_fields:
            a = out.get(name)
            if a is not None:
                out[name] = a[:, :, : self._used(name)]
        return out

    @state.setter
    def state(self, v):
        CompressedKVCache.state.fset(self, v)
        self._call = None


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
    _shared = ("config", "_kq", "_vq")

    def _init_layout(self):
        c = self.config
        self.residual_length = int(c.residual_length)
        self.key_sub_dim, self.value_sub_dim = int(c.key_sub_dim), int(c.value_sub_dim)
        self.key_bits, self.value_bits = int(c.key_codebook_bits), int(c.value_codebook_bits)
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
        return (c.head_dim, c.key_sub_dim, c.value_sub_dim, c.key_codebook_bits, c.value_codebook_bits, c.seed)

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

    @property
    def used_nbytes(self) -> int:
        """Bytes of the used rows of every per-token array (spare capacity and constants left out)."""
        return sum(a[:, :, : self._used(n)].nbytes for n in self.array_fields
                   if (a := getattr(self, n)) is not None)

    def _dims(self, head_dim=None, value_dim=None) -> tuple[int, int]:
        shape = getattr(self, "_shape", None)
        d = head_dim or (shape[1] if shape else self.config.head_dim)
        return d, value_dim or (shape[2] if shape else d)

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

    @property
    def full_seq_bytes(self) -> int:
        """What a float16 cache would hold for the same tokens (no spare capacity)."""
        if self.win_k is None:
            return 0
        B, H, _, D = self.win_k.shape
        return B * H * self.offset * (D + self.win_v.shape[-1]) * 2

    @classmethod
    def _merge_batch(cls, caches):
        from .turboquant_rvq_batch import TurboQuantRVQBatchKVCache

        return TurboQuantRVQBatchKVCache.from_caches(caches)

    # ---- copies share the constants
    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            shared = k in self._shared or isinstance(v, mx.Dtype)
            setattr(new, k, v if shared else copy.deepcopy(v, memo))
        return new
