"""KIVI (Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", ICML 2024, arXiv 2402.02750).

Observation (paper, section 3): keys have a few fixed *outlier channels*, values do not; so keys are
quantized **per channel** (the elements of one channel over a group of tokens share a scale and zero
point) and values **per token** (the channels of one token, in groups, share them). Tokens that do
not yet fill a key group stay in a full-precision **residual** buffer. Algorithm 1 of the paper:

* prefill: attention over the prompt in full precision; then the prompt's complete key groups are
  quantized per channel, values per token, the remainder goes to the residual buffers;
* decode: the new token is appended to the residual; when the key residual reaches its length, it is
  quantized (one vectorized step) and appended to the quantized part; attention is
  ``softmax([q·Q(K_g)ᵀ, q·K_rᵀ]) · [Q(V_g); V_r]``, i.e. scores over the quantized part and the
  residual part, one softmax across both, ``P_g·Q(V_g) + P_r·V_r``.

This implementation (``bit_width_inlier`` = b ∈ {2, 3, 4, 8}, ``kivi_group_size`` = G):

* Layout (B batch, H kv heads, D/Dv head dims, all buffers preallocated and grown in steps by
  ``eviction.grow_rows``'s policy, never concatenated per token):

  - keys, per channel, stored **transposed**: ``k_codes [B, H, D, groups*words]`` (uint32; the codes of
    ``K^T`` quantized along the token axis in groups of G tokens) with ``k_scales``/``k_biases``
    ``[B, H, D, groups]`` (float16). ``mx.quantized_matmul(q, k_codes, ..., transpose=False)`` is
    ``q @ Q(K)^T`` directly.
  - values, per token: ``v_codes [B, H, tokens, Dv*b/32]`` with ``v_scales``/``v_biases``
    ``[B, H, tokens, Dv/Gv]`` (float16), channel groups of ``Gv = gcd(Dv, G)`` (= G when G divides the
    head dimension). ``mx.quantized_matmul(p, v_codes, ..., transpose=False)`` is ``p @ Q(V)``.
  - residual: ``res_k [B, H, G, D]``, ``res_v [B, H, G, Dv]`` float16, rows ``[0, n_res)`` used.

  Codes/scales come from ``primitives.groupquant`` (``mx.quantize`` when (b, group) allows it, its
  reference kernel otherwise, e.g. for 16-channel heads).
* ``update_and_fetch`` returns the rows stored *before* this call in their stored form (dequantized
  quantized part, then the float16 residual) followed by this call's new rows as given: the new rows
  are attended in full precision (as the paper's prefill does) and only stored compressed. ``attend``
  (dispatch point) computes the same thing on the compressed form: scores over [quantized part,
  full-precision part = residual rows + new rows], one softmax across both, ``P_q·Q(V) + P_f·V_f``
  (with a sink logit column when the model has attention sinks), GQA by grouping the queries
  [B, H, rep, N, D], mlx_lm masks (None, "causal" bottom-right aligned, boolean or additive arrays)
  and attention sinks honoured. On the CPU and on Metal it uses ``mx.quantized_matmul`` on the codes
  when both layouts are MLX's (measured faster than dequantize + float32 matmul on the CPU); on MLX's
  CUDA backend, which has no quantized_matmul kernel for these shapes, it dequantizes and uses matmuls
  (``attend_path`` overrides the choice; both paths are tested on the CPU), except for decode steps
  (one query row, ``attend_path="auto"``, b in {2, 4, 8}): those take the fused kernel of
  ``veloxquant_mlx.cache.kernels.kivi`` (codes read once, split-K online softmax, merged with the
  residual and the own row; checked against the op path at first use). Measured on an H200
  (``veloxquant bench --shape llama-8b --random-weights``, 2026-12-01,
  docs/data/h200_decode_kernels_2026-12-01.json): 0.67x the plain cache's decode speed at 8k and
  0.58x at 32k (0.38x / 0.34x with the dequantize path in the same session).
  ``_dense()`` is the current stored form (dequantized groups + residual), in token order.
* ``nbytes`` = bytes of the arrays held (codes, float16 scales/biases, residual buffers, including
  the buffers' spare capacity); ``used_nbytes`` leaves the spare capacity out.

Deviations from the paper (all deliberate):

* Residual length R = G (the paper uses a separate R, e.g. 128, a multiple of G): keys and values
  share one residual of 0..G-1 tokens, and both are quantized when G tokens complete a key group. The
  paper's value residual is a sliding window of exactly R tokens; here values leave the residual with
  their key group, so the newest 0..G-1 tokens (not always the newest R) are in float16.
* The residual is stored in float16 (the paper: the model's full precision). Quantization reads the
  float16 rows too (float16 scales/biases whatever the compute dtype).
* A group completed by a decode step is quantized *after* that step's attention (the step sees those
  G tokens as float16 residual rows plus its own row); the paper quantizes the group first. Prefill chunks after the first see
  the earlier chunks compressed (the paper's prefill is one full-precision pass over the prompt).
* Value channel groups are ``gcd(Dv, G)`` wide instead of G when G does not divide the head dim.
* Trim is exact only when it drops residual tokens and/or whole quantized groups (then the state is
  identical to never having seen those tokens); a trim that would cut into a quantized group raises
  ``ValueError`` instead of silently keeping lossy rows.
* Keys are quantized after RoPE (mlx_lm hands the cache rotated keys).
* GPU prefill chunks (N > 1, ``attend_path="auto"``) attend through the fused sdpa kernel over the
  lazily dequantized rows instead of the codes (same result; no [N, M] score matrix held). Elsewhere a
  prefill chunk over a stored past is one online softmax over tiles of whole groups
  (``_attend_chunk``, ``attention.online_softmax_attention``): the paper's one softmax, computed
  without the [N, M] score matrix, so a chunked prefill peaks below the plain cache.

Measured (SmolLM2-135M float32 on the CPU, 480 essay tokens prefilled in one chunk + 32
teacher-forced decode steps, G = 32, vs mlx_lm's plain KVCache): mean next-token KL 0.012 at 4 bits,
0.21 at 2 bits (mlx_lm's per-token QuantizedKVCache, group 32, after the same full-precision prefill:
0.065 / 1.27). Quantizing a call's own rows before its attention instead raises the 2-bit decode KL
to 0.49 (and the prompt's last-token KL from 0 to 2.1). Bytes per token per KV head at D = 64:
80 (4 bits) and 48 (2 bits) plus the 32-row float16 residual, vs 256 for float16.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..attention import (bool_mask, dense_blocks, group_queries, online_softmax_attention, tile_ranges,
                         tile_rows, ungroup)
from ..base import register
from ..contract import CompressedKVCache, register_with_mlx_lm
from ..errors import QuantizerConfigError
from ..primitives.buffers import grow_columns, grow_rows
from ..primitives import groupquant as gq
from .. import dispatch, kernels
from ..kernels import kivi as kivi_kernel

KIVI_BITS = (2, 3, 4, 8)
RES_DTYPE = mx.float16


@register_with_mlx_lm
@register("kivi")
class KIVIKVCache(CompressedKVCache):
    """KIVI: keys per-channel, values per-token, b-bit groups of G, float16 residual of < G tokens."""
    chunk_invariant = True  # groups of G at absolute positions, the rest in the residual
    exact_trim = False  # raises ValueError when the trimmed rows completed a quantized group
    trim_exact_or_raises = True  # ... and is exact when it does not raise
    batchable = True  # merge -> KIVIBatchKVCache (kivi_batch.py); variants keep raising BatchingNotSupported

    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name")

    #: "auto" (quantized_matmul on a Metal GPU, dequantize + float32 matmul otherwise), "dequant" or
    #: "quantized_matmul" (needs MLX layouts: b and G, Gv in groupquant.MX_GROUPS).
    attend_path = "auto"

    n_quant = 0  # quantized tokens (a multiple of G)
    n_res = 0  # float16 residual tokens (< G)
    dtype_name = "float16"  # dtype of the rows last handed to the cache (dense outputs use it)
    _call = None  # (quantized, residual, past res_k, past res_v, new keys, new values) of the last call
    _kernel_off = False  # set while the op path runs as the decode kernel's reference

    # ---------------------------------------------------------------- layout
    def _init_layout(self):
        b = self.config.bit_width_inlier
        if isinstance(b, bool) or b not in KIVI_BITS:
            raise QuantizerConfigError("bit_width_inlier", b, "one of 2, 3, 4, 8 for method='kivi'")
        self.qbits = int(b)  # not ``bits``: mlx_lm routes any cache with ``bits`` to its own kernel
        self.group = int(self.config.kivi_group_size)
        self._call = None

    def value_group(self, dv: int) -> int:
        """Channel-group width of the per-token value quantization for head dim ``dv``."""
        return math.gcd(dv, self.group)

    def _key_words(self) -> int:
        return gq.words_per_group(self.qbits, self.group)

    def _uses_qmm(self) -> bool:
        path = self.attend_path
        if path == "dequant":
            return False
        dv = self.res_v.shape[-1]
        ok = gq.uses_mx_kernels(self.qbits, self.group) and gq.uses_mx_kernels(self.qbits, self.value_group(dv))
        if path == "quantized_matmul":
            if not ok:
                raise ValueError(
                    f"attend_path='quantized_matmul' needs MLX layouts (bits in {gq.MX_BITS}, groups in "
                    f"{gq.MX_GROUPS}); got bits={self.qbits}, key group={self.group}, "
                    f"value group={self.value_group(dv)}"
                )
            return True
        # auto: quantized_matmul on the CPU and on Metal (measured on the CPU, SmolLM2 shape, 1k context:
        # 0.89x the plain cache's decode speed vs 0.74x for dequantize + float32 matmul; see
        # docs/RESULTS.md); on MLX's CUDA backend quantized_matmul has no kernel for these shapes
        # (docs/GPU.md), so CUDA dequantizes.
        cuda = mx.default_device().type == mx.DeviceType.gpu and not mx.metal.is_available()
        return ok and not cuda

    # ---------------------------------------------------------------- storage
    def _store(self, keys, values):
        B, H, N, D = keys.shape
        G = self.group
        if self.res_k is None:
            self.res_k = mx.zeros((B, H, G, D), dtype=RES_DTYPE)
            self.res_v = mx.zeros((B, H, G, values.shape[-1]), dtype=RES_DTYPE)
        self.dtype_name = str(keys.dtype).rsplit(".", 1)[-1]
        q0, r0 = self.n_quant, self.n_res
        past_k = self.res_k[:, :, :r0] if r0 else None
        past_v = self.res_v[:, :, :r0] if r0 else None
        self._call = (q0, r0, past_k, past_v, keys, values)
        k16, v16 = keys.astype(RES_DTYPE), values.astype(RES_DTYPE)
        total = r0 + N
        nq = (total // G) * G  # tokens that complete key groups now
        rem = total - nq
        if nq == 0:
            self.res_k[:, :, r0:total] = k16
            self.res_v[:, :, r0:total] = v16
        else:
            take = nq - r0
            kb = k16[:, :, :take] if r0 == 0 else mx.concatenate([past_k, k16[:, :, :take]], axis=2)
            vb = v16[:, :, :take] if r0 == 0 else mx.concatenate([past_v, v16[:, :, :take]], axis=2)
            self._append_groups(kb, vb)
            if rem:
                self.res_k[:, :, :rem] = k16[:, :, N - rem :]
                self.res_v[:, :, :rem] = v16[:, :, N - rem :]
        self.n_res = rem

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        """Quantize ``kb``/``vb`` [B, H, n, D] (n a multiple of G) and append them."""
        self._forget_rows()
        G, b = self.group, self.qbits
        t0, n = self.n_quant, kb.shape[2]
        kq = gq.quantize_per_channel(kb, b, G)  # codes [B, H, D, (n/G)*w], scales [B, H, D, n/G]
        vq = gq.quantize(vb, b, self.value_group(vb.shape[-1]))  # codes [B, H, n, W], scales [B, H, n, Dv/Gv]
        self.v_codes = grow_rows(self.v_codes, t0, vq.codes)
        self.v_scales = grow_rows(self.v_scales, t0, vq.scales)
        self.v_biases = grow_rows(self.v_biases, t0, vq.biases)
        cap_groups = self.v_codes.shape[2] // G  # keys follow the values' capacity
        g0, w = t0 // G, self._key_words()
        self.k_codes = grow_columns(self.k_codes, g0 * w, kq.codes, cap_groups * w)
        self.k_scales = grow_columns(self.k_scales, g0, kq.scales, cap_groups)
        self.k_biases = grow_columns(self.k_biases, g0, kq.biases, cap_groups)
        self.n_quant = t0 + n

    # ---------------------------------------------------------------- decoding the stored form
    def _keys_t(self, n: int, dtype=mx.float32) -> mx.array:
        """Dequantized K^T [B, H, D, n] of the first ``n`` quantized tokens."""
        g = n // self.group
        w = self._key_words()
        return gq.dequantize(self.k_codes[..., : g * w], self.k_scales[..., :g], self.k_biases[..., :g],
                             self.qbits, self.group, dtype)

    def _values(self, n: int, dtype=mx.float32) -> mx.array:
        """Dequantized V [B, H, n, Dv] of the first ``n`` quantized tokens."""
        dv_group = self.value_group(self.res_v.shape[-1])
        return gq.dequantize(self.v_codes[:, :, :n], self.v_scales[:, :, :n], self.v_biases[:, :, :n],
                             self.qbits, dv_group, dtype)

    def _rows(self, n_quant: int, res_k, res_v, new_k=None, new_v=None, dtype=None):
        """Dense (K, V) of: ``n_quant`` quantized tokens, residual rows, new rows (in order)."""
        ks, vs = [], []
        if n_quant:
            k, v = self._quantized_rows(n_quant)
            ks.append(k)
            vs.append(v)
        if res_k is not None:
            ks.append(res_k)
            vs.append(res_v)
        if new_k is not None:
            ks.append(new_k)
            vs.append(new_v)
        if len(ks) == 1:
            return ks[0].astype(dtype), vs[0].astype(dtype)
        return (mx.concatenate([k.astype(dtype) for k in ks], axis=2),
                mx.concatenate([v.astype(dtype) for v in vs], axis=2))

    def _quantized_rows(self, n: int):
        """Dense (K, V) of the first ``n`` quantized tokens; on the decode kernels' backend their lazy
        graph is reused between group completions while the dispatch point is installed (the model's
        attention then never evaluates them: see ``kernels._common.RowsMemo``)."""
        if not self._own_layout():  # a variant storing other arrays: no memo
            return self._keys_t(n).swapaxes(-1, -2), self._values(n)
        memo = self.__dict__.get("_dense_memo")
        if memo is None:
            memo = self._dense_memo = kernels._common.RowsMemo()
        out = memo.get(n, self.k_codes)
        if out is None:
            out = memo.put(n, self.k_codes, (self._keys_t(n).swapaxes(-1, -2), self._values(n)),
                           keep=dispatch.installed() and kernels.kernels_enabled())
        return out

    def _own_layout(self) -> bool:
        """Whether this cache stores and reads KIVI's own codes (variants that change what the codes
        mean, or store other arrays, override these)."""
        cls = type(self)
        return all(getattr(cls, f) is getattr(KIVIKVCache, f) for f in ("_keys_t", "_values", "_append_groups"))

    def _forget_rows(self) -> None:
        memo = self.__dict__.get("_dense_memo")
        if memo is not None:
            memo.clear()

    def _dense(self):
        dtype = getattr(mx, self.dtype_name)
        r = self.n_res
        res = (self.res_k[:, :, :r], self.res_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_quant, *res, dtype=dtype)

    def update_and_fetch(self, keys, values):
        """Store the new rows; return the rows stored before this call (stored form) + the new rows."""
        self._check_input(keys, values)
        self._store(keys, values)
        self.offset += keys.shape[2]
        q0, _, past_k, past_v, new_k, new_v = self._call
        return self._rows(q0, past_k, past_v, new_k, new_v, dtype=keys.dtype)

    def stored_rows(self) -> int:
        return self.n_quant + self.n_res

    # ---------------------------------------------------------------- attention on the codes
    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is None or call[4].shape[2] != N or keys.shape[2] != call[0] + call[1] + N:
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        q0, r0, past_k, past_v, new_k, new_v = call
        mask = self._own_mask(mask, queries, keys)
        if q0 + r0 == 0:  # nothing stored before this call: plain attention over the new rows
            return mx.fast.scaled_dot_product_attention(queries, new_k, new_v, scale=scale, mask=mask,
                                                        sinks=sinks)
        if N == 1 and q0 and not self._kernel_off and self._decode_kernel_ready(mask, new_k.shape[-1], new_v.shape[-1]):
            self._call = call
            return self._decode_checked(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if self.attend_path == "sdpa" or (N > 1 and self.attend_path == "auto" and mx.default_device().type == mx.DeviceType.gpu):
            # GPU prefill chunk: the fused sdpa kernel over the (lazily dequantized) rows is faster and
            # never holds the [N, M] score matrix; decode steps stay on the codes.
            return super().attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if N > 1:  # a prefill chunk over a stored past: online softmax over tiles (``_attend_chunk``)
            return self._attend_chunk(queries, call, scale=scale, mask=mask, sinks=sinks)
        use_qmm = self._uses_qmm()

        B, Hq, _, D = queries.shape
        H = new_k.shape[1]
        rep, M = Hq // H, q0 + r0 + N
        q = (group_queries(queries, H).astype(mx.float32) * scale).reshape(B, H, rep * N, D)
        G, b = self.group, self.qbits

        # full-precision part: the past residual rows (float16) then this call's rows (as given)
        fk, fv = new_k, new_v
        if r0:
            fk = mx.concatenate([past_k.astype(new_k.dtype), new_k], axis=2)
            fv = mx.concatenate([past_v.astype(new_v.dtype), new_v], axis=2)
        fv = fv.astype(mx.float32)
        s_full = q @ fk.astype(mx.float32).swapaxes(-1, -2)  # [B, H, rep*N, r0+N]
        parts = [s_full]
        if q0:  # quantized part: q · Q(K)^T straight from the transposed per-channel codes
            g, w = q0 // G, self._key_words()
            if use_qmm:
                s_q = mx.quantized_matmul(q, self.k_codes[..., : g * w], self.k_scales[..., :g],
                                          self.k_biases[..., :g], transpose=False, group_size=G, bits=b)
            else:
                s_q = q @ self._keys_t(q0)
            parts.insert(0, s_q)
        if sinks is not None:  # a sink is one more logit per query head, with no value
            sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, rep, 1, 1), (B, H, rep, N, 1))
            parts.insert(0, sink.reshape(B, H, rep * N, 1))
        s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        lead = s.shape[-1] - M  # 1 with sinks, else 0
        s = s.reshape(B, H, rep, N, s.shape[-1])

        if isinstance(mask, str):  # "causal", bottom-right aligned: only this call's rows can be hidden
            if N > 1:
                cols = mx.arange(r0 + N)[None] - r0
                visible = cols <= mx.arange(N)[:, None]
                s_tail = mx.where(visible, s[..., lead + q0 :], -mx.inf)
                s = mx.concatenate([s[..., : lead + q0], s_tail], axis=-1)
        elif mask is not None:
            m = bool_mask(mask, N, M, H)
            if lead:
                m = mx.concatenate([mx.ones((*m.shape[:-1], 1), dtype=mx.bool_), m], axis=-1)
            s = mx.where(m, s, -mx.inf)

        # one softmax across the quantized and the full-precision parts
        p = mx.softmax(s, axis=-1, precise=True).reshape(B, H, rep * N, s.shape[-1])
        out = p[..., lead + q0 :] @ fv
        if q0:
            p_q = p[..., lead : lead + q0]
            if use_qmm:
                dv_group = self.value_group(new_v.shape[-1])
                out = out + mx.quantized_matmul(p_q, self.v_codes[:, :, :q0], self.v_scales[:, :, :q0],
                                                self.v_biases[:, :, :q0], transpose=False,
                                                group_size=dv_group, bits=b)
            else:
                out = out + p_q @ self._values(q0)
        return ungroup(out.reshape(B, H, rep, N, out.shape[-1])).astype(queries.dtype)

    def _attend_chunk(self, queries, call, *, scale, mask, sinks):
        """Attention of a multi-row call over the quantized groups, the residual and its own rows as an
        online softmax over tiles of whole groups (``attention.online_softmax_attention``): no [N, M]
        score matrix, only tiles of 1/16 of it, so a prefill chunk's transients stay below the plain
        cache's dense attention."""
        q0, r0, past_k, past_v, new_k, new_v = call
        B, Hq, N, D = queries.shape
        H = new_k.shape[1]
        rep, M = Hq // H, q0 + r0 + N
        q = (group_queries(queries, H).astype(mx.float32) * scale).reshape(B, H, rep * N, D)
        tile = tile_rows(B * Hq * N, M, self.group)
        blocks = []
        if q0:
            ranges = tile_ranges(0, q0, tile)
            blocks += [(a, b, sf, vf) for (a, b), (sf, vf) in zip(ranges, self._quantized_tiles(q, ranges))]
        fk, fv = new_k, new_v
        if r0:
            fk = mx.concatenate([past_k.astype(new_k.dtype), new_k], axis=2)
            fv = mx.concatenate([past_v.astype(new_v.dtype), new_v], axis=2)
        blocks += dense_blocks(q, fk, fv, q0, tile)
        return online_softmax_attention((B, H, rep, N), blocks, M, mask, sinks, queries.dtype)

    def _quantized_tiles(self, q, ranges):
        """(scores_fn, values_fn) per range of quantized rows (whole groups): ``quantized_matmul`` on the
        codes where the layouts allow it, else the tile dequantized to float32. Variants with their own
        storage (``_keys_t`` / ``_values`` overridden) decode their rows once and are tiled from those."""
        if type(self)._keys_t is not KIVIKVCache._keys_t or type(self)._values is not KIVIKVCache._values:
            n = ranges[-1][1]
            kt, vv = self._keys_t(n), self._values(n)
            return [(lambda a=a, c=c: q @ kt[..., a:c], lambda p, a=a, c=c: p @ vv[:, :, a:c]) for a, c in ranges]
        G, b, w = self.group, self.qbits, self._key_words()
        dv_group = self.value_group(self.res_v.shape[-1])
        use_qmm = self._uses_qmm()

        def scores(t0, t1):
            g0, g1 = t0 // G, t1 // G
            codes, sc, bi = (self.k_codes[..., g0 * w : g1 * w], self.k_scales[..., g0:g1],
                             self.k_biases[..., g0:g1])
            if use_qmm:
                return mx.quantized_matmul(q, codes, sc, bi, transpose=False, group_size=G, bits=b)
            return q @ gq.dequantize(codes, sc, bi, b, G, mx.float32)

        def values(p, t0, t1):
            codes, sc, bi = self.v_codes[:, :, t0:t1], self.v_scales[:, :, t0:t1], self.v_biases[:, :, t0:t1]
            if use_qmm:
                return mx.quantized_matmul(p, codes, sc, bi, transpose=False, group_size=dv_group, bits=b)
            return p @ gq.dequantize(codes, sc, bi, b, dv_group, mx.float32)

        return [(lambda a=a, c=c: scores(a, c), lambda p, a=a, c=c: values(p, a, c)) for a, c in ranges]

    # ---------------------------------------------------------------- decode: the fused GPU kernel
    def _decode_kernel_ready(self, mask, d: int, dv: int) -> bool:
        """One query row over KIVI's own layout (subclasses that change what the codes mean keep the op
        path), a string/None mask, a layout the kernel reads, and the CUDA backend."""
        return (self._own_layout() and isinstance(mask, (str, type(None))) and self.attend_path == "auto"
                and kivi_kernel.supported(self.qbits, self.group, self.value_group(dv), d, dv)
                and kernels.kernels_enabled())

    def _decode_attend(self, queries, *, scale, sinks=None):
        """One query row in two launches: the decode kernel's split-K partials over the codes plus the
        float16 residual and the call's own row, then the merge kernel (one softmax)."""
        call, self._call = self._call, None
        q0, r0, past_k, past_v, new_k, new_v = call
        if self.n_quant == q0:  # the residual buffer still holds the past rows first
            res_k, res_v = self.res_k, self.res_v
        else:  # this call completed a group: the past rows are the record's
            res_k, res_v = (past_k, past_v) if r0 else (self.res_k, self.res_v)
        exact = (res_k, res_v, r0, res_k, res_v, 0, new_k, new_v)
        m, l, acc = kivi_kernel.kivi_partials(queries, scale, self.k_codes, self.k_scales, self.k_biases,
                                              self.v_codes, self.v_scales, self.v_biases, q0, self.qbits,
                                              self.group, self.value_group(new_v.shape[-1]), exact)
        return kernels.merge_kernel(m, l, acc, sinks, hadamard=False, out_dtype=queries.dtype)

    def _decode_checked(self, queries, keys, values, *, scale, mask, sinks):
        """The kernel path, checked once per process against the op path (``kernels.checked_call``)."""
        return kernels.checked_call(
            "kivi", self, lambda: self._decode_attend(queries, scale=scale, sinks=sinks),
            lambda: self._op_attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks))

    def _op_attend(self, queries, keys, values, *, scale, mask, sinks):
        self._kernel_off = True
        try:
            return self.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        finally:
            self._kernel_off = False

    @classmethod
    def _merge_batch(cls, caches):
        from .kivi_batch import KIVIBatchKVCache

        return KIVIBatchKVCache.from_caches(caches)

    # ---------------------------------------------------------------- trim
    def _trim_rows(self, n: int) -> int:
        """Exact trims only: the ``n`` newest tokens must be residual tokens plus whole groups."""
        self._call = None
        self._forget_rows()
        if n <= self.n_res:
            self.n_res -= n
            return n
        extra = n - self.n_res
        if extra % self.group:
            keep = self.n_quant - (extra // self.group + 1) * self.group
            raise ValueError(
                f"KIVIKVCache: trimming {n} tokens would cut into a quantized group of {self.group} tokens "
                f"(positions {keep}..{keep + self.group - 1} exist only as {self.qbits}-bit codes); exact "
                f"trims drop at most the {self.n_res} residual tokens plus whole groups "
                f"(n - {self.n_res} a multiple of {self.group})"
            )
        if extra > self.n_quant:
            raise ValueError(f"cannot trim {n} tokens: only {self.stored_rows()} are stored")
        self.n_quant -= extra
        self.n_res = 0
        return n

    # ---------------------------------------------------------------- accounting
    @property
    def used_nbytes(self) -> int:
        """Bytes of the filled part: quantized tokens (codes + scales/biases) and the residual buffers
        (the buffers' spare capacity left out)."""
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        dv = self.res_v.shape[-1]
        G, b = self.group, self.qbits
        gv = self.value_group(dv)
        groups = self.n_quant // G
        key = B * H * D * groups * (4 * self._key_words() + 2 * 2)
        value = B * H * self.n_quant * (dv // gv) * (4 * gq.words_per_group(b, gv) + 2 * 2)
        return key + value + self.res_k.nbytes + self.res_v.nbytes

    @property
    def full_seq_bytes(self) -> int:
        """What a float16 cache would hold for the same tokens (no spare capacity)."""
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        return B * H * self.offset * (D + self.res_v.shape[-1]) * 2

    @property
    def compression_ratio(self) -> float:
        return self.full_seq_bytes / self.nbytes if self.nbytes else 1.0
