"""TurboQuant-RVQ (the library's default method): random rotation + two-stage residual vector quantization of
keys and values, float16 sink rows and a float16 window of the newest tokens.

Paper: Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal Distortion
Rate", arXiv 2504.19874: a normalised vector times a random rotation ``Pi`` has coordinates of one known law, so
a data-oblivious codebook computed once codes it within a small constant (<= sqrt(3)*pi/2) of the ``4^-b`` MSE
bound. This method keeps the rotation and the data-oblivious codebooks, with a residual VQ on sub-vectors.

Per KV head (keys: ``s, B = key_sub_dim, key_codebook_bits``; values: ``value_sub_dim, value_codebook_bits``):
``g = ||x||`` (float16), ``y = Pi x / g`` (``Pi`` a seeded Haar-random orthogonal matrix per head dim, shared by
keys, values, heads and layers); each of the ``d / s`` sub-vectors gets a stage-1 centroid (``B1 = min(B, 8)``
bits) plus a cell-scaled stage-2 centroid (``B - B1`` bits), beam-encoded over the 4 nearest stage-1 centroids
(``primitives.rvq``: seeded k-means on random unit vectors' sub-vectors, jointly refined; cached per process
and in ``config.store`` as ``tqrvq.d{d}.s{s}.b{B}.seed{seed}``), codes bit-packed. Rows leave
``window.ResidualWindowCache``'s float16 window in whole blocks. Defaults at d = 64: 3.25 key + 1.25 value bits
per coordinate, 36 bytes per token per KV head (0.141x fp16), more on short contexts where the window's 16-bit
rows weigh (``bytes_per_token``, ``bits_per_coordinate``; measured KL and bytes: docs/RESULTS.md
"TurboQuant-RVQ", ``scripts/bench_turboquant_rvq.py``). Choices measured there: the second stage
(``STAGE2_STUDY``: a QJL stage was worse than none), ``B1 = min(B, 8)``, the sinks (KL 0.128 without them).

Deviations from the paper:

1. Vector instead of scalar quantization (two residual k-means stages on ``s``-dim sub-vectors, ``B / s`` bits
   per coordinate), with a beam-search encoder and cell-scaled second stage.
2. No QJL stage; the score estimate is biased like the paper's MSE variant (``STAGE2_STUDY``).
3. Norms are stored in float16 (the paper assumes exact norms); norms above 65504 saturate.
4. Keys and values are both quantized this way, with no outlier-channel split.
5. A float16 window of the newest ``R`` .. ``R + QUANT_BLOCK - 1`` tokens (``R = residual_length``) and the
   stream's first 4 tokens in float16 (attention sinks: StreamingLLM arXiv 2309.17453); a call's own rows, and
   rows leaving the window during it, are attended in full precision; later prefill chunks see earlier ones
   compressed.
6. Codebooks come from k-means on samples (not the exact density), refined jointly; a saved cache is decoded
   with the loading process's codebooks (the same for the same seed and platform; an
   ``NpyDirectoryArtifactStore`` pins them across machines).

Decode attention reads the codes: the op path scores keys by lookup tables; on CUDA a one-row step goes to
``kernels.turboquant_rvq`` (one launch per layer, checked once against the op path), on the CPU to
``native/turboquant_rvq_cpu.cpp`` (each row's codes read once: keys by lookup tables, values summed per (piece,
centroid) and multiplied by the codebooks once; checked likewise), while the dense rows
``update_and_fetch`` returns are built lazily and kept between compactions (never evaluated there). A GPU prefill
chunk attends in the rotated domain (``_rotated_chunk``); on CUDA its codes and rows come from
``kernels.turboquant_rvq_rows`` (one launch each). On the CPU rows are encoded by
``native/turboquant_rvq_encode_cpu.cpp`` (the same beam search, checked once against the op path).

``nbytes`` also counts the shared rotation and codebooks (``constant_nbytes``, with the decode kernel's transposed
rotation once built) on the first cache of each set (``counts_constants``); ``merge`` builds
``turboquant_rvq_batch.py``'s form (op path at decode).
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from ... import attention, kernels, native
from ...base import register
from ...contract import register_with_mlx_lm
from ...errors import QuantizerConfigError
from ...kernels import turboquant_rvq as tq_kernel, turboquant_rvq_rows as tq_rows
from ...primitives import blocks
from ...primitives.bitpack import pack_bits, unpack_bits
from ...primitives.buffers import grow_rows, reserve_rows
from ...primitives.rotation import random_orthogonal
from ...primitives.rvq import BEAM, RVQCodebook, row_bytes, rvq_codebook, split_bits
from ...attention import on_cpu_streams
from ...window import QUANT_BLOCK, SINK_ROWS, Partials, ResidualWindowCache  # noqa: F401 (SINK_ROWS re-exported)

__all__ = ["TurboQuantRVQKVCache", "RVQCodebook", "rvq_codebook", "split_bits", "row_bytes", "QUANT_BLOCK",
           "STAGE2_STUDY"]

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
        self.dim, self.sub_dim, self.bits, self.seed = dim, sub_dim, bits, seed
        self.rot_t = _rotation(dim, seed)  # y = x @ rot_t (= Pi x); x = y @ rot_t.T
        self.back = None  # rot_t.T contiguous, once the decode kernel asks (``rotation_back``)
        self.in_dtype: dict = {}  # (dtype, back) -> rot_t or its transpose in a 16-bit dtype (``rotation_in``)
        self.cb = rvq_codebook(dim, sub_dim, bits, seed, store)

    def arrays(self) -> list[mx.array]:
        return [self.rot_t, *([self.back] if self.back is not None else []), *self.in_dtype.values(),
                *self.cb.arrays()]

    def rotation_in(self, dtype, back: bool = False) -> mx.array:
        """``rot_t`` (``back``: its transpose) in ``dtype``: a GPU prefill chunk's rotations as one matmul in the
        model's dtype (built on first use per dtype, then counted with the other constants)."""
        if dtype == mx.float32:
            return self.rotation_back() if back else self.rot_t
        if (dtype, back) not in self.in_dtype:
            r = mx.contiguous((self.rot_t.T if back else self.rot_t).astype(dtype))
            mx.eval(r)
            self.in_dtype[dtype, back] = r
        return self.in_dtype[dtype, back]

    def rotation_back(self) -> mx.array:
        """``rot_t.T`` contiguous: the decode kernel's matrix from the rotated value domain back (built on first use,
        one per (dim, seed), then counted with the other constants)."""
        self.back = _rotation_back(self.dim, self.seed)  # (cached per process)
        return self.back

    def encode(self, x: mx.array, owner=None):
        """``x [B, H, n, d]`` -> (packed stage-1 codes, packed stage-2 codes or None, float16 norms). With an
        ``owner`` cache on the kernels' backend ``kernels.turboquant_rvq_rows`` scales the rotated rows ``Pi x`` by
        their norm (``|Pi x| = |x|``) and encodes them in one launch (checked once per process against the op path)."""
        if owner is not None and kernels.kernels_enabled() and tq_rows.supported(self.cb):
            return tq_rows.checked_encode(owner, self.cb, x.astype(mx.float32) @ self.rot_t, lambda: self._encoded(x))
        if owner is not None and native.available():
            out = tq_rows.checked_encode(owner, self.cb, x.astype(mx.float32) @ self.rot_t, lambda: self._encoded(x),
                                         kernel=_cpu_encode, name="turboquant_rvq_encode_cpu")
            if x.shape[-2] > QUANT_BLOCK:  # a prompt's rows: coded before the layer's attention is queued, as the op
                blocks.wait_for([a for a in out if a is not None])  # path's blocks are (none left to the chunk's end)
            return out
        return self._encoded(x)

    def _encoded(self, x: mx.array):
        """``encode``'s op path: norms, rotated unit vectors, their codes packed."""
        xf = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(xf * xf, axis=-1))
        i, j = self.cb.encode((xf / mx.maximum(norm, 1e-30)[..., None]) @ self.rot_t)
        p2 = pack_bits(j, self.cb.bits2) if j is not None else None
        return pack_bits(i, self.cb.bits1), p2, mx.minimum(norm, _FP16_MAX).astype(mx.float16)

    def codes(self, p1, p2):
        """Unpacked codes (uint8 ``[.., S]``) from packed planes."""
        return tuple(unpack_bits(p, b, self.cb.n_sub) if p is not None else None
                     for p, b in ((p1, self.cb.bits1), (p2, self.cb.bits2)))

    def decode_rotated(self, p1, p2) -> mx.array:
        return self.cb.decode(*self.codes(p1, p2))


_QUANTIZERS: dict[tuple, _Quantizer] = {}


def _cpu_encode(cb: RVQCodebook, z: mx.array):
    """``encode``'s words and norms of rotated rows ``z`` by the CPU kernel (``native/turboquant_rvq_encode_cpu.cpp``:
    the op path's beam search, 16 centroids a vector, rows over the cores)."""
    out = native.module().turboquant_rvq_encode(z, cb.c1, cb.sigma, cb.c2, BEAM)
    return (out[0], out[1], out[2]) if cb.c2 is not None else (out[0], None, out[1])


@functools.lru_cache(maxsize=None)
def _rotation(dim: int, seed: int) -> mx.array:
    """``Pi^T`` for ``(dim, seed)``: one array per process, shared by keys, values and all layers."""
    r = mx.contiguous(random_orthogonal(dim, seed).T)
    mx.eval(r)
    return r


@functools.lru_cache(maxsize=None)
def _rotation_back(dim: int, seed: int) -> mx.array:
    back = mx.contiguous(_rotation(dim, seed).T)
    mx.eval(back)
    return back


def _quantizer(dim, sub_dim, bits, seed, store) -> _Quantizer:
    key = (dim, sub_dim, bits, seed)
    if key not in _QUANTIZERS:
        _QUANTIZERS[key] = _Quantizer(dim, sub_dim, bits, seed, store)
    elif store is not None:
        rvq_codebook(dim, sub_dim, bits, seed, store)  # make sure the store holds it too
    return _QUANTIZERS[key]


@register_with_mlx_lm
@register("turboquant_rvq")
class TurboQuantRVQKVCache(ResidualWindowCache):
    """TurboQuant rotation + two-stage residual VQ of keys and values, float16 window, attention on the codes."""

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
        for field, sub in (("key", self.key_sub_dim), ("value", self.value_sub_dim)):
            if c.head_dim % sub:
                raise QuantizerConfigError(f"{field}_sub_dim", sub, f"a divisor of head_dim={c.head_dim}")
        self._kq = self._vq = None
        stage2 = {"k": split_bits(self.key_bits)[1], "v": split_bits(self.value_bits)[1]}
        self.array_fields = tuple(n for n in TurboQuantRVQKVCache.array_fields  # no stage-2 plane when B <= 8
                                  if not n.endswith("codes2") or stage2[n[0]])

    def _quantizers(self, dk: int, dv: int):
        """The (key, value) quantizers for the dims seen (built lazily)."""
        if self._kq is None or self._kq.dim != dk or self._vq.dim != dv:
            for field, sub, d in (("key", self.key_sub_dim, dk), ("value", self.value_sub_dim, dv)):
                if d % sub:
                    raise QuantizerConfigError(f"{field}_sub_dim", sub, f"a divisor of the head dimension {d}")
            self._kq = _quantizer(dk, self.key_sub_dim, self.key_bits, self.seed, self.config.store)
            self._vq = _quantizer(dv, self.value_sub_dim, self.value_bits, self.seed, self.config.store)
        return self._kq, self._vq

    def _qs(self):
        return self._quantizers(*self._shape[1:])

    def _store(self, keys, values):
        self._quantizers(keys.shape[-1], values.shape[-1])  # constants (and dim checks) up front
        super()._store(keys, values)

    def _short_steps(self) -> bool:
        return True  # a repeated step's quantizers exist (the checked call built them)

    def _append_quantized(self, keys, values):
        t0 = self.n_quant
        for prefix, qz, x in zip(("k_", "v_"), self._quantizers(keys.shape[-1], values.shape[-1]), (keys, values)):
            for name, rows in zip(("codes1", "codes2", "norms"), qz.encode(x, self)):
                if rows is not None:
                    name = prefix + name
                    setattr(self, name, grow_rows(reserve_rows(getattr(self, name), t0, rows, QUANT_BLOCK), t0, rows))

    def _planes(self, prefix: str, n: int, a: int = 0):
        """Packed code planes of quantized rows ``a .. n`` (stage 2 None when there is none)."""
        p2 = getattr(self, prefix + "codes2", None)
        return getattr(self, prefix + "codes1")[:, :, a:n], (p2[:, :, a:n] if p2 is not None else None)

    def _quantized_dense(self, n, dtype=None):
        """The first ``n`` quantized rows, dense (in ``dtype`` when given: the cast memoised with them)."""
        return self._memo_rows(n, self.k_codes1, lambda: tuple(x if dtype is None else x.astype(dtype)
                                                               for x in self._decoded(n)))

    def _decoded(self, n):
        return tuple((qz.decode_rotated(*self._planes(prefix, n)) @ qz.rot_t.T)
                     * getattr(self, prefix + "norms")[:, :, :n].astype(mx.float32)[..., None]
                     for prefix, qz in zip(("k_", "v_"), self._qs()))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        def op():
            return ResidualWindowCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)

        if self._decode_kernel_ready(queries, keys, mask):  # kernels: checked once against op()
            return kernels.checked_call(
                "turboquant_rvq", self, lambda: self._decode_attend(queries, scale=scale, sinks=sinks), op)
        if self._cpu_kernel_ready(queries, keys, mask):
            return kernels.checked_call("turboquant_rvq_cpu", self, lambda: self._attend_part(
                queries, keys, self._cpu_part, scale=scale, mask=mask, sinks=sinks), op)
        return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _cpu_kernel_ready(self, queries, keys, mask) -> bool:
        """A one-row step over codes the CPU kernel (``native/turboquant_rvq_cpu.cpp``) takes: built here, head dims
        up to 256, up to 32 query heads per KV head."""
        return self._one_row_over_codes(queries, keys, mask) and native.available() and self._cpu_dims_fit(
            queries.shape[1])

    def _cpu_dims_fit(self, query_heads: int) -> bool:
        """Head dims the CPU kernels hold (up to 256) and up to 32 query heads per KV head."""
        H, D, DV = self._shape
        return max(D, DV) <= 256 and query_heads // H <= 32

    def _cpu_part(self, q, n: int, counts=()) -> Partials:
        """The first ``n`` quantized rows' partials for scaled float32 queries ``q`` [B, H, R, D] by the CPU kernel:
        each row's codes read once, keys scored by lookup tables, values summed per (piece, centroid) and turned
        back once (a batch form's ``counts``: sequence b's first ``counts[b]`` rows)."""
        kq, vq = self._qs()
        planes = [(getattr(self, p + "codes1"), getattr(self, p + "codes2", None), getattr(self, p + "norms"), qz.cb)
                  for p, qz in (("k_", kq), ("v_", vq))]
        (k1, k2, kn, kcb), (v1, v2, vn, vcb) = planes
        m, l, acc = native.module().turboquant_rvq_decode(  # noqa: E741
            q @ kq.rot_t, k1, k2, kn, kcb.c1, kcb.sigma, kcb.c2, v1, v2, vn, vcb.c1, vcb.sigma, vcb.c2, n,
            self._shape[2], counts=list(counts))
        return Partials(m, l, acc @ vq.rot_t.T)

    def _decode_attend(self, queries, *, scale, sinks=None):
        return tq_kernel.decode_attend(self, queries, scale, sinks)

    def _attend_chunk(self, queries, keys, values, call, *, scale, mask, sinks):
        if mx.default_device().type == mx.DeviceType.gpu:
            return self._rotated_chunk(queries, call, scale=scale, mask=mask, sinks=sinks)
        return super()._attend_chunk(queries, keys, values, call, scale=scale, mask=mask, sinks=sinks)

    def _rotated_chunk(self, queries, call, *, scale, mask, sinks):
        """A prefill chunk on a GPU: MLX's fused attention in the rotated domain (``q.k = (Pi q).(Pi k)``), where the
        past is its codebook rows times its norms: no dense rotation back over the whole past per chunk (the rows
        ``update_and_fetch`` returned are never evaluated); the sinks, window and chunk rows (one matmul) and the
        queries are rotated instead, and the output back once, each a matmul in the model's dtype (16-bit rows: the
        rotation rounded to it, an error of the rows' own rounding; float32 rotations would add launches)."""
        kq, vq = self._qs()
        dt = queries.dtype
        s0 = call.s0

        def rows(prefix, qz, sink, past, new):
            """Rotated keys or values in order: sinks, the quantized rows (codebook rows times norms), the rest."""
            exact = [x.astype(dt) for x in (sink, past, new) if x is not None]
            exact = (exact[0] if len(exact) == 1 else mx.concatenate(exact, axis=2)) @ qz.rotation_in(dt)
            n, norms = call.q0, getattr(self, prefix + "norms")
            if not n:
                return exact

            def op():
                quant = (qz.decode_rotated(*self._planes(prefix, n)) * norms[:, :, :n].astype(mx.float32)[..., None]
                         ).astype(dt)
                return mx.concatenate([exact[:, :, :s0], quant, exact[:, :, s0:]] if s0 else [quant, exact], axis=2)

            if not (kernels.kernels_enabled() and tq_rows.supported(qz.cb, rows=True)):
                return op()
            planes = (getattr(self, prefix + "codes1"), getattr(self, prefix + "codes2", None))
            return tq_rows.checked_rows(self, qz.cb, planes, norms, n, exact, s0, op)

        sk, sv = self._sinks(s0) or (None, None)
        k = rows("k_", kq, sk, call.past_k, call.new_k)
        v = rows("v_", vq, sv, call.past_v, call.new_v)
        out = mx.fast.scaled_dot_product_attention(queries @ kq.rotation_in(dt), k, v, scale=scale, mask=mask,
                                                   sinks=sinks)
        return out @ vq.rotation_in(dt, back=True)

    def _decode_kernel_ready(self, queries, keys, mask) -> bool:
        """One query row over quantized rows, a string/None mask, shapes the kernel reads, the CUDA backend."""
        if not (self._one_row_over_codes(queries, keys, mask) and kernels.kernels_enabled()):
            return False
        H, D, DV = self._shape
        return tq_kernel.supported(D, DV, queries.shape[1] // H, self.key_sub_dim, self.key_bits, self.value_sub_dim,
                                   self.value_bits)

    def _quantized_part(self, q, n: int):
        """Scores over the first ``n`` quantized rows by LUT on the codes for decode-sized calls (``LUT_MAX_ROWS``
        query rows per KV head), else from the codes decoded to rotated-domain rows; values as ``sum_t p_t g_t
        centroid[code_t]`` rotated back once; the queries are rotated once per call."""
        kq, vq = self._qs()
        qr = q @ kq.rot_t
        lut = q.shape[2] <= LUT_MAX_ROWS

        def norms(prefix, a, b):
            return getattr(self, prefix + "norms")[:, :, a:b].astype(mx.float32)[:, :, None, :]

        def scores(a, b):
            codes = kq.codes(*self._planes("k_", b, a))
            s = self._lut_scores(kq, qr, *codes) if lut else qr @ kq.cb.decode(*codes).swapaxes(-1, -2)
            return s * norms("k_", a, b)

        # a long CPU step builds the values' codewords on a second stream while this one scores the keys (MLX runs a
        # CPU stream on one thread); the rows in two ranges, as waterfill's, was slower here
        s, rows = on_cpu_streams([lambda: scores(0, n), lambda: vq.decode_rotated(*self._planes("v_", n))], n,
                                 attention.CPU_SPLIT_DECODE_MIN_ROWS)
        return s, lambda p: ((p * norms("v_", 0, n)) @ rows) @ vq.rot_t.T

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
            self._qs()  # a cache restored from a state
        unique = {id(a): a for a in self._kq.arrays() + self._vq.arrays()}
        return sum(a.nbytes for a in unique.values())

    @property
    def nbytes(self) -> int:
        return super().nbytes + (self.constant_nbytes if self.counts_constants else 0)

    def bytes_per_token(self, head_dim: Optional[int] = None, value_dim: Optional[int] = None) -> int:
        """Theoretical bytes of one quantized token per KV head (codes + norms of K and V)."""
        d, dv = self._dims(head_dim, value_dim)
        return row_bytes(d, self.key_sub_dim, self.key_bits) + row_bytes(dv, self.value_sub_dim, self.value_bits)

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
