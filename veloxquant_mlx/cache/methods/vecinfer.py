"""VecInfer (Yao, Yang, Tong, Lin, Liu, Luan, Wang, "VecInfer: Efficient LLM Inference with Low-Bit KV
Cache via Outlier-Suppressed Vector Quantization", arXiv 2510.06175).

Paper idea: vector quantization (VQ) of the KV cache uses bits better than scalar quantization, but the
few outlier channels of the keys stretch the key distribution so that a k-means codebook wastes most
of its codewords on the bulk and still misses the outliers. VecInfer first *suppresses the outliers*
with a dual transform -- a per-channel smoothing scale followed by a Hadamard rotation -- so the
transformed keys are near-isotropic, then product-quantizes them; attention is computed from the
codes with a per-query lookup table over codewords (fused into a CUDA kernel in the paper).

Algorithm here (a subclass of ``KIVIKVCache``: same float16 residual of < 32 tokens, same
``update_and_fetch``; whole 32-token blocks are VQ-encoded), for a layer with H KV heads of dim D:

* keys: ``k' = (k / s) @ R`` with ``s [H, D]`` smoothing factors and ``R = randomized_hadamard(D, seed)``
  (orthogonal; a Haar-random orthogonal matrix when D is not a power of two). ``k'`` is cut into
  ``D / key_sub_dim`` sub-vectors of ``key_sub_dim`` dims; each is replaced by the index of its nearest
  codeword in a codebook of ``2**key_codebook_bits`` entries (defaults: 4 dims, 12 bits = 3 bits per
  coordinate). Codes are bit-packed per token at ``key_codebook_bits`` bits each (low 8 bits and the
  remaining high bits in two ``uint32`` streams; ``primitives.bitpack``); each stream of a token is
  rounded up to whole 32-bit words, which is exact for the defaults at D = 64 (16 x 8 + 16 x 4 and
  8 x 8 bits) and for any setting where sub-vectors x bits is a multiple of 32.
* values: the same product VQ with ``value_sub_dim`` / ``value_codebook_bits`` (defaults 8 dims,
  8 bits = 1 bit per coordinate; 2 bits per coordinate on average over K and V, the paper's headline
  setting), without the transform (see deviations).
* smoothing factors ``s[h, i] = sqrt(max |k[.., h, :, i]|)`` over the calibration block (the first block
  the cache encodes), or ``smooth_factors`` from the config ([D] or [H, D]).
* codebooks: ``key_codebook`` / ``value_codebook`` from the config ([K, sub_dim] shared by all heads, or
  [H, K, sub_dim] per head), else fitted on the calibration block: one codebook per layer, shared by
  its heads and sub-vector positions (after the transform all coordinates look alike -- the paper's
  point), seeded k-means (``seed``; random-row init, 6 Lloyd iterations on a seeded sample of at most
  4 rows per codeword (and 64K rows),
  assignments chunked over the codebook so memory is O(rows x 1024)).
* attention (dispatch point): for the VQ part, ``q' = (q * s) @ R`` gives ``q . k_hat = q' . k'_hat``, so
  with the lookup table ``LUT[j, c] = q'_j . C_c`` (one [sub-vectors x codewords] table per query)
  ``score(t) = sum_j LUT[j, code_j(t)]`` -- a gather over the codes, never materializing the keys.
  Values: ``P_vq @ V_hat`` with V_hat gathered from the value codebook. The float16 residual and the
  call's own rows are full-precision columns of the same softmax (KIVI's attend structure). When the
  gathered table would exceed ``LUT_MAX`` entries (long prefill chunks) the identical product
  ``q @ K_hat^T`` over dequantized keys is used instead.
* ``fused_sdpa=True``: prefill chunks (N > 1) go through MLX's fused sdpa over the dequantized rows that
  ``update_and_fetch`` returned (same math, no score matrix held); ``fused_sdpa_max_ctx`` limits this to
  contexts of at most that many tokens; ``fused_sdpa_memory_bound=True`` routes decode steps there too.
  ``use_metal_kernels`` is accepted (None/bool) and has no effect: there are no Metal kernels here.

Bytes per token per KV head: ``(D/key_sub_dim)*key_codebook_bits/8 + (Dv/value_sub_dim)*
value_codebook_bits/8`` (D = 64, defaults: 24 + 8 = 32 B vs 256 B float16), plus per layer the
codebooks (float16: 4096*4*2 + 256*8*2 = 36 KiB) and smoothing factors, plus the < 32-row residual.

Measured (veloxquant eval --task kld: SmolLM2-135M float32 on the CPU, 512 essay tokens prefilled + 32 scored
decode steps, mean next-token KL vs the uncompressed cache; kv_bytes = bytes held / float16 cache):
defaults (K 4 dims / 12 bits, V 8 dims / 8 bits): KL 0.415, top-1 0.69, kv_bytes 0.273 (the fit of the
4096-word key codebooks costs ~4 s per layer on this loaded 2-core CPU); K 4/8, V 4/8 (2 bits per
coordinate each): KL 0.214, top-1 0.69, kv_bytes 0.195 (KIVI 2-bit: 0.21 at 0.24).

Deviations from the paper (deliberate):

* Calibration is online, on the first 32-token-multiple block each layer encodes (the paper calibrates
  smoothing scales offline on a calibration set); config arrays replace it.
* Values are vector-quantized without smoothing/rotation (the paper's transforms target key outliers).
* Keys are quantized after RoPE (mlx_lm hands the cache rotated keys).
* The newest < 32 tokens stay float16 (KIVI's residual) and a call's own rows are attended in full
  precision; the paper quantizes every token.
* No fused CUDA/Metal kernel: the LUT gather is plain MLX ops.
* Trim: exact for residual tokens and whole blocks; a trim into the calibration block raises
  ``ValueError`` (the remaining codes were made with statistics of the removed tokens) unless it
  removes every encoded token (then the calibration is redone, as in a fresh cache).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np

from ..attention import bool_mask, group_queries, ungroup
from ..base import register
from ..contract import CompressedKVCache, register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.buffers import grow_rows
from ..primitives import bitpack
from ..primitives.rotation import random_orthogonal, randomized_hadamard, seeded_rng
from .kivi import KIVIKVCache

BLOCK = 32  # tokens per encoded block (= the float16 residual's capacity)
LUT_MAX = 1 << 25  # gathered LUT entries above which scores use dequantized keys
KMEANS_ITERS = 6
KMEANS_ROWS_PER_CODE = 4  # fit sample: at most 4 rows per codeword (and 64K rows)
KMEANS_MAX_ROWS = 1 << 16
_CHUNK = 1024
_TAG_VQ = 0x0A7E_0B01


def _int(v, lo, hi=None):
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)


# ------------------------------------------------------------------------------------ VQ helpers
def vq_assign(x: mx.array, cb: mx.array) -> mx.array:
    """Nearest codeword index for rows ``x [Hc, n, d]`` in codebooks ``cb [Hc, K, d]`` -> int32 [Hc, n].
    Chunked over the codebook (running minimum), so memory is O(n * 1024)."""
    x = x.astype(mx.float32)
    cb = cb.astype(mx.float32)
    K = cb.shape[1]
    best_d = best_i = None
    for s in range(0, K, _CHUNK):
        c = cb[:, s : s + _CHUNK]
        d = mx.sum(c * c, axis=-1)[:, None, :] - 2.0 * (x @ c.swapaxes(-1, -2))
        i = mx.argmin(d, axis=-1)
        m = mx.min(d, axis=-1)
        if best_d is None:
            best_d, best_i = m, i.astype(mx.int32)
        else:
            upd = m < best_d
            best_i = mx.where(upd, i.astype(mx.int32) + s, best_i)
            best_d = mx.minimum(m, best_d)
    return best_i


def fit_codebook(x: mx.array, k: int, seed: int, iters: int = KMEANS_ITERS) -> mx.array:
    """Seeded k-means: ``k`` codewords for the rows of ``x [Hc, n, d]`` -> float32 [Hc, k, d]. Init =
    random rows (with replacement when n < k); Lloyd iterations batched over the leading axis; an
    empty cluster keeps its codeword."""
    Hc, n, d = x.shape
    x = x.astype(mx.float32)
    rng = seeded_rng(_TAG_VQ, seed)
    cap = min(KMEANS_MAX_ROWS, KMEANS_ROWS_PER_CODE * k)
    if n > cap:
        x = x[:, mx.array(np.sort(rng.choice(n, cap, replace=False)).astype(np.int32))]
        n = cap
    cb = x[:, mx.array(rng.choice(n, k, replace=n < k).astype(np.int32))]
    off = (mx.arange(Hc, dtype=mx.int32) * k)[:, None]
    flat_x = x.reshape(Hc * n, d)
    for _ in range(iters):
        lab = (vq_assign(x, cb) + off).reshape(-1)
        sums = mx.zeros((Hc * k, d), dtype=mx.float32).at[lab].add(flat_x)
        cnt = mx.zeros((Hc * k,), dtype=mx.float32).at[lab].add(mx.ones((Hc * n,), dtype=mx.float32))
        new = (sums / mx.maximum(cnt, 1.0)[:, None]).reshape(Hc, k, d)
        cb = mx.where((cnt > 0).reshape(Hc, k, 1), new, cb)
        mx.eval(cb)
    return cb


def pack_codes(codes: mx.array, bits: int):
    """Codes [.., m] in [0, 2**bits) -> (low 8-bit stream, high-bit stream or None), uint32 words."""
    c = codes.astype(mx.uint32)
    lo = bitpack.pack_bits(mx.bitwise_and(c, 0xFF), min(bits, 8))
    hi = bitpack.pack_bits(mx.right_shift(c, 8), bits - 8) if bits > 8 else None
    return lo, hi


def unpack_codes(lo: mx.array, hi, bits: int, m: int) -> mx.array:
    c = bitpack.unpack_bits(lo, min(bits, 8), m).astype(mx.int32)
    if bits > 8:
        c = c + mx.left_shift(bitpack.unpack_bits(hi, bits - 8, m).astype(mx.int32), 8)
    return c


def _to_head_rows(x: mx.array, hc: int, sub: int) -> mx.array:
    """[B, H, n, D] -> sub-vector rows [Hc, B*n*D/sub (*H if Hc == 1), sub]."""
    B, H, n, D = x.shape
    if hc == 1:
        return x.reshape(1, -1, sub)
    return x.transpose(1, 0, 2, 3).reshape(H, -1, sub)


def _from_head_rows(codes: mx.array, shape) -> mx.array:
    """Inverse of ``_to_head_rows`` for codes: [Hc, rows] -> [B, H, n, D/sub]."""
    B, H, n, m = shape
    if codes.shape[0] == 1:
        return codes.reshape(B, H, n, m)
    return codes.reshape(H, B, n, m).transpose(1, 0, 2, 3)


def _lookup(codes: mx.array, cb: mx.array) -> mx.array:
    """Codewords of ``codes [B, H, n, m]`` from ``cb [Hc, K, d]`` -> [B, H, n, m*d] float32."""
    Hc, K, d = cb.shape
    B, H, n, m = codes.shape
    flat = codes if Hc == 1 else codes + (mx.arange(H, dtype=mx.int32) * K)[None, :, None, None]
    return mx.take(cb.reshape(Hc * K, d).astype(mx.float32), flat, axis=0).reshape(B, H, n, m * d)


def _as_array(v, name, ndims):
    a = mx.array(np.asarray(v, dtype=np.float32))
    if a.ndim not in ndims:
        raise QuantizerConfigError(name, getattr(v, "shape", v), f"an array with {' or '.join(map(str, ndims))} dims")
    return a


@register_with_mlx_lm
@register("vecinfer")
class VecInferKVCache(KIVIKVCache):
    """VecInfer: smoothing + Hadamard on keys, product VQ of keys and values, LUT attention on codes."""
    chunk_invariant = False  # smoothing factors and codebooks fitted on the first encoded block
    exact_trim = False  # KIVI's rule: raises ValueError when the trimmed rows completed a block

    array_fields = ("k_lo", "k_hi", "v_lo", "v_hi", "key_cb", "val_cb", "smooth", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name", "calib_tokens")

    calib_tokens = 0  # encoded tokens the fitted statistics were computed from (0: none fitted)

    # ---------------------------------------------------------------- layout / validation
    def _init_layout(self):
        c = self.config
        for f in ("key_sub_dim", "value_sub_dim"):
            if not _int(getattr(c, f), 1, 256):
                raise QuantizerConfigError(f, getattr(c, f), "an int in 1..256 dividing the head dim")
        for f in ("key_codebook_bits", "value_codebook_bits"):
            if not _int(getattr(c, f), 1, 16):
                raise QuantizerConfigError(f, getattr(c, f), "an int in 1..16 (codebook of 2**bits codewords)")
        if c.use_metal_kernels is not None and not isinstance(c.use_metal_kernels, bool):
            raise QuantizerConfigError("use_metal_kernels", c.use_metal_kernels, "None or a bool")
        if c.fused_sdpa is not None and not isinstance(c.fused_sdpa, bool):
            raise QuantizerConfigError("fused_sdpa", c.fused_sdpa, "None or a bool")
        if c.fused_sdpa_max_ctx is not None and not _int(c.fused_sdpa_max_ctx, 1):
            raise QuantizerConfigError("fused_sdpa_max_ctx", c.fused_sdpa_max_ctx, "None or an int >= 1")
        if not isinstance(c.fused_sdpa_memory_bound, bool):
            raise QuantizerConfigError("fused_sdpa_memory_bound", c.fused_sdpa_memory_bound, "a bool")
        self.ks, self.vs = int(c.key_sub_dim), int(c.value_sub_dim)
        self.kbits, self.vbits = int(c.key_codebook_bits), int(c.value_codebook_bits)
        self.group = BLOCK
        self.qbits = self.kbits  # informational (KIVI's attribute name)
        self._given = {}
        for name, field, dims in (("smooth", "smooth_factors", (1, 2)), ("key_cb", "key_codebook", (2, 3)),
                                  ("val_cb", "value_codebook", (2, 3))):
            v = getattr(c, field)
            if v is not None:
                a = _as_array(v, field, dims)
                if field != "smooth_factors":
                    sub, bits = (self.ks, self.kbits) if field == "key_codebook" else (self.vs, self.vbits)
                    if a.shape[-1] != sub or a.shape[-2] > (1 << bits):
                        raise QuantizerConfigError(field, tuple(a.shape),
                                                   f"[K, {sub}] or [H, K, {sub}] with K <= 2**{bits}")
                    a = a if a.ndim == 3 else a[None]
                elif bool(mx.any(a <= 0)):
                    raise QuantizerConfigError(field, "non-positive entries", "positive factors")
                self._given[name] = a
        self._call = None

    def _uses_qmm(self) -> bool:
        return False

    def _rot(self, d: int) -> mx.array:
        seed = int(self.config.seed)
        return randomized_hadamard(d, seed) if d & (d - 1) == 0 else random_orthogonal(d, seed)

    # ---------------------------------------------------------------- calibration
    def _calibrate(self, kb: mx.array, vb: mx.array) -> None:
        B, H, n, D = kb.shape
        Dv = vb.shape[-1]
        if D % self.ks:
            raise QuantizerConfigError("key_sub_dim", self.ks, f"a divisor of the key head dim {D}")
        if Dv % self.vs:
            raise QuantizerConfigError("value_sub_dim", self.vs, f"a divisor of the value head dim {Dv}")
        k32 = kb.astype(mx.float32)
        if "smooth" in self._given:
            s = self._given["smooth"]
            if s.shape[-1] != D or (s.ndim == 2 and s.shape[0] != H):
                raise QuantizerConfigError("smooth_factors", tuple(s.shape), f"[{D}] or [{H}, {D}]")
            s = mx.broadcast_to(s.reshape(-1, D), (H, D))
        else:
            s = mx.sqrt(mx.maximum(mx.abs(k32).max(axis=(0, 2)), 1e-4))  # [H, D]
        self.smooth = s.astype(mx.float32)
        seed = int(self.config.seed)
        for name, x, sub, bits in (("key_cb", self._transform(k32), self.ks, self.kbits),
                                   ("val_cb", vb.astype(mx.float32), self.vs, self.vbits)):
            if name in self._given:
                cb = self._given[name]
                if cb.shape[0] not in (1, H):
                    raise QuantizerConfigError("key_codebook" if name == "key_cb" else "value_codebook",
                                               tuple(cb.shape), f"[K, {sub}] or [{H}, K, {sub}]")
            else:
                cb = fit_codebook(_to_head_rows(x, 1, sub), 1 << bits, seed + (name == "val_cb"))
            setattr(self, name, cb.astype(mx.float16))
        self.calib_tokens = n

    def _transform(self, k32: mx.array) -> mx.array:
        """Smoothing + rotation: ``(k / s) @ R`` for keys [B, H, n, D] (float32)."""
        return (k32 / self.smooth[None, :, None, :]) @ self._rot(k32.shape[-1])

    # ---------------------------------------------------------------- encode / decode
    def _encode(self, x: mx.array, cb: mx.array, sub: int) -> mx.array:
        B, H, n, D = x.shape
        codes = vq_assign(_to_head_rows(x, cb.shape[0], sub), cb)
        return _from_head_rows(codes, (B, H, n, D // sub))

    def _append_groups(self, kb, vb):
        if self.key_cb is None:
            self._calibrate(kb, vb)
        t0 = self.n_quant
        kc = self._encode(self._transform(kb.astype(mx.float32)), self.key_cb, self.ks)
        vc = self._encode(vb.astype(mx.float32), self.val_cb, self.vs)
        klo, khi = pack_codes(kc, self.kbits)
        vlo, vhi = pack_codes(vc, self.vbits)
        self.v_lo = grow_rows(self.v_lo, t0, vlo)
        if vhi is not None:
            self.v_hi = grow_rows(self.v_hi, t0, vhi)
        self.k_lo = grow_rows(self.k_lo, t0, klo)
        if khi is not None:
            self.k_hi = grow_rows(self.k_hi, t0, khi)
        self.n_quant = t0 + kb.shape[2]

    def _key_codes(self, n: int) -> mx.array:
        m = self.res_k.shape[-1] // self.ks
        return unpack_codes(self.k_lo[:, :, :n], None if self.k_hi is None else self.k_hi[:, :, :n], self.kbits, m)

    def _value_codes(self, n: int) -> mx.array:
        m = self.res_v.shape[-1] // self.vs
        return unpack_codes(self.v_lo[:, :, :n], None if self.v_hi is None else self.v_hi[:, :, :n], self.vbits, m)

    def _keys_t(self, n, dtype=mx.float32):
        """Dequantized K^T [B, H, D, n]: codewords, rotated back, times the smoothing factors."""
        kt = _lookup(self._key_codes(n), self.key_cb)  # transformed space [B, H, n, D]
        k = (kt @ self._rot(kt.shape[-1]).T) * self.smooth[None, :, None, :]
        return k.swapaxes(-1, -2).astype(dtype)

    def _values(self, n, dtype=mx.float32):
        return _lookup(self._value_codes(n), self.val_cb).astype(dtype)

    # ---------------------------------------------------------------- LUT scores
    def lut_scores(self, q: mx.array, n: int) -> mx.array:
        """``q [B, H, Q, D]`` (already scaled) against the first ``n`` VQ keys -> [B, H, Q, n], as
        ``sum_j LUT[j, code_j]`` with ``LUT = (q * s) @ R`` split in sub-vectors times the codebook."""
        B, H, Q, D = q.shape
        m, sub = D // self.ks, self.ks
        qt = ((q.astype(mx.float32) * self.smooth[None, :, None, :]) @ self._rot(D)).reshape(B, H, Q, m, sub)
        cb = self.key_cb.astype(mx.float32)  # [Hc, K, sub]
        lut = qt @ cb[None, :, None].swapaxes(-1, -2)  # [B, H, Q, m, K]
        codes = self._key_codes(n).transpose(0, 1, 3, 2)[:, :, None]  # [B, H, 1, m, n]
        idx = mx.broadcast_to(codes, (B, H, Q, m, n))
        return mx.take_along_axis(lut, idx, axis=-1).sum(axis=3)

    # ---------------------------------------------------------------- attention
    def _fused(self, N: int, M: int) -> bool:
        c = self.config
        if not c.fused_sdpa:
            return False
        if c.fused_sdpa_max_ctx is not None and M > c.fused_sdpa_max_ctx:
            return False
        return N > 1 or bool(c.fused_sdpa_memory_bound)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is None or call[4].shape[2] != N or keys.shape[2] != call[0] + call[1] + N:
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        q0, r0, past_k, past_v, new_k, new_v = call
        mask = self._own_mask(mask, queries, keys)
        if q0 == 0 or self._fused(N, keys.shape[2]):
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        B, Hq, _, D = queries.shape
        H = new_k.shape[1]
        rep, M = Hq // H, q0 + r0 + N
        q = (group_queries(queries, H).astype(mx.float32) * scale).reshape(B, H, rep * N, D)
        fk, fv = new_k, new_v
        if r0:
            fk = mx.concatenate([past_k.astype(new_k.dtype), new_k], axis=2)
            fv = mx.concatenate([past_v.astype(new_v.dtype), new_v], axis=2)
        parts = [q @ fk.astype(mx.float32).swapaxes(-1, -2)]
        if rep * N * (D // self.ks) * q0 <= LUT_MAX:
            parts.insert(0, self.lut_scores(q, q0))
        else:
            parts.insert(0, q @ self._keys_t(q0))
        if sinks is not None:
            sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, rep, 1, 1), (B, H, rep, N, 1))
            parts.insert(0, sink.reshape(B, H, rep * N, 1))
        s = mx.concatenate(parts, axis=-1)
        lead = s.shape[-1] - M
        s = s.reshape(B, H, rep, N, s.shape[-1])
        if isinstance(mask, str):
            if N > 1:
                cols = mx.arange(r0 + N)[None] - r0
                visible = cols <= mx.arange(N)[:, None]
                s = mx.concatenate([s[..., : lead + q0], mx.where(visible, s[..., lead + q0 :], -mx.inf)], axis=-1)
        elif mask is not None:
            m = bool_mask(mask, N, M, H)
            if lead:
                m = mx.concatenate([mx.ones((*m.shape[:-1], 1), dtype=mx.bool_), m], axis=-1)
            s = mx.where(m, s, -mx.inf)
        p = mx.softmax(s, axis=-1, precise=True).reshape(B, H, rep * N, s.shape[-1])
        out = p[..., lead + q0 :] @ fv.astype(mx.float32) + p[..., lead : lead + q0] @ self._values(q0)
        return ungroup(out.reshape(B, H, rep, N, out.shape[-1])).astype(queries.dtype)

    # ---------------------------------------------------------------- trim
    def _trim_rows(self, n):
        extra = n - self.n_res
        if extra > 0 and extra % BLOCK == 0 and extra <= self.n_quant:
            left = self.n_quant - extra
            if 0 < left < self.calib_tokens:
                raise ValueError(
                    f"VecInferKVCache: trimming {n} tokens would remove part of the calibration block "
                    f"(the first {self.calib_tokens} encoded tokens) whose statistics made the remaining codes")
            dropped = super()._trim_rows(n)
            if left == 0:  # nothing encoded is left: calibrate again, as a fresh cache would
                self.key_cb = self.val_cb = self.smooth = None
                self.calib_tokens = 0
            return dropped
        return super()._trim_rows(n)

    # ---------------------------------------------------------------- accounting
    def bytes_per_token_budget(self, d: int, dv: int) -> float:
        """Theoretical code bytes per token per KV head."""
        return (d // self.ks) * self.kbits / 8 + (dv // self.vs) * self.vbits / 8

    @property
    def used_nbytes(self) -> int:
        """Codes of the encoded tokens (whole packed words), codebooks, smoothing factors, residual."""
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        Dv = self.res_v.shape[-1]
        per = 0
        for lo, hi, m, bits in ((self.k_lo, self.k_hi, D // self.ks, self.kbits),
                                (self.v_lo, self.v_hi, Dv // self.vs, self.vbits)):
            if lo is not None:
                per += bitpack.packed_nbytes(m, min(bits, 8)) + (bitpack.packed_nbytes(m, bits - 8) if bits > 8 else 0)
        fixed = sum(a.nbytes for a in (self.key_cb, self.val_cb, self.smooth) if a is not None)
        return B * H * self.n_quant * per + fixed + self.res_k.nbytes + self.res_v.nbytes

    @property
    def compression_ratio(self) -> float:
        return self.full_seq_bytes / self.nbytes if self.nbytes else 1.0
