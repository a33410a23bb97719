"""The grouped-quantization layout (KIVI's): the family base of KIVI and its variants, beside ``contract.py``.

Keys per channel over groups of G tokens, values per token in channel groups ``Gv = gcd(Dv, G)``, a 2-byte
residual (float16; the rows' own dtype for KIVI itself: ``_residual_dtype``) of the tokens not yet completing a
group (the paper and deviations: ``methods/quantization/kivi.py``).
Buffers grow by ``primitives.buffers``'s policy: keys **transposed**, ``k_codes [B, H, D, groups*words]`` with
float16 ``k_scales``/``k_biases [B, H, D, groups]`` (so ``mx.quantized_matmul(q, k_codes, ..., transpose=False)``
is ``q @ Q(K)^T``); ``v_codes [B, H, tokens, Dv*b/32]``, ``v_scales``/``v_biases [B, H, tokens, Dv/Gv]``;
``res_k [B, H, G, D]``/``res_v``, rows ``[0, n_res)`` used. ``update_and_fetch`` returns the stored rows
(stored form) then the call's; ``attend`` computes the same attention on the codes (``_attend_stored``).
Variants change what the codes mean by overriding ``_append_groups`` / ``_keys_t`` / ``_values`` (and
``_key_scores`` / ``_value_out`` to attend on their own codes); one whose codes are not MLX's affine layout
sets ``dequant_only`` to the reason.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import attention, dispatch, kernels, native
from .attention import cpu_parts, dense_attention, on_cpu_streams, split_on_cpu_streams
from .contract import CompressedKVCache
from .errors import QuantizerConfigError
from .kernels import kivi as kivi_kernel, kivi_rows
from .primitives import blocks, groupquant as gq
from .primitives.buffers import dtype_name, fp16_row_bytes, grow_columns, grow_rows
from .window import Partials, WindowCall, attend_joint, attend_tiled, concat_rows

KIVI_BITS = (2, 3, 4, 8)
QMM_MAX_ROWS = 8  # query rows per head up to which "auto" attends with quantized_matmul (see _uses_qmm)
RES_DTYPE = mx.float16


class GroupedQuantCache(CompressedKVCache):
    """Keys per channel, values per token, b-bit groups of G tokens, float16 residual of < G tokens."""

    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases", "res_k", "res_v")
    scalar_fields = ("n_quant", "n_res", "dtype_name")

    #: "auto" (quantized_matmul on the CPU and Metal, dequantize + float32 matmul on CUDA), "dequant" or
    #: "quantized_matmul" (needs MLX layouts: b and G, Gv in groupquant.MX_GROUPS).
    attend_path = "auto"
    #: Why a variant's codes cannot go through ``mx.quantized_matmul`` ("" for KIVI's own): its attention
    #: then dequantizes, and ``attend_path="quantized_matmul"`` raises naming it.
    dequant_only = ""
    #: A variant storing KIVI's own codes behind exact lead rows (``_lead_rows``; kivi_sink's sinks), whose
    #: ``_keys_t`` / ``_values`` only prepend those rows: the decode kernels (CPU, CUDA) read its codes as KIVI's.
    own_codes_after_lead_rows = False
    #: trim raises ValueError when the trimmed rows completed a quantized group, else is exact (False: broken)
    trim_exact_or_raises = True
    #: ``_check_trim_rows``' text for a cut into a group (fields: cls, n, G, first, last, bits, res)
    cut_group_text = ("{cls}: trimming {n} tokens would cut into a quantized group of {G} tokens (positions "
                      "{first}..{last} exist only as {bits}-bit codes); exact trims drop at most the {res} residual "
                      "tokens plus whole groups (n - {res} a multiple of {G})")
    #: Variants fitting statistics on their first encoded block: the scalar field of its end (encoded tokens, 0: none
    #: fitted) and the fields the fit set; a trim may not cut into the block and resets them when it empties the codes.
    calib_field = ""
    refit_fields: tuple[str, ...] = ()
    _fit_holder = property(lambda self: self, doc="The cache holding the fit (xKV: the group's first layer).")
    n_quant = 0  # quantized tokens (a multiple of G)
    n_res = 0  # float16 residual tokens (< G, or more while ``_holds_back``)
    dtype_name = "float16"  # dtype of the rows last handed to the cache (dense outputs use it)
    _call = None  # (quantized, residual, past res_k, past res_v, new keys, new values) of the last call
    _kernel_off = False  # set while the op path runs as the decode kernel's reference

    def _init_layout(self):
        b = self.config.bit_width_inlier
        if isinstance(b, bool) or b not in KIVI_BITS:
            raise QuantizerConfigError("bit_width_inlier", b, f"one of 2, 3, 4, 8 for method={self.config.method!r}")
        self.qbits = int(b)  # not ``bits``: mlx_lm routes any cache with ``bits`` to its own kernel
        self.group = int(self.config.options.group_size)

    def value_group(self, dv: int) -> int:
        """Channel-group width of the per-token value quantization for head dim ``dv``."""
        return math.gcd(dv, self.group)

    def kivi_bytes_per_token(self, d: int, dv: int) -> float:
        """KIVI's bytes per token per head, both sides: b-bit codes plus a float16 scale and bias per group."""
        return self.qbits * (d + dv) / 8 + 4 * d / self.group + 4 * dv / self.value_group(dv)

    def _key_words(self) -> int:
        return gq.words_per_group(self.qbits, self.group)

    def _uses_qmm(self, rows: int = 1) -> bool:
        """Whether ``rows`` query rows per head read the codes with ``mx.quantized_matmul`` (``attend_path``)."""
        path = self.attend_path
        if self.dequant_only and path == "quantized_matmul":
            raise ValueError(f"{self.method_name} attends through dequantize + matmul ({self.dequant_only})")
        if path == "dequant" or self.dequant_only:
            return False
        dv = self.res_v.shape[-1]
        ok = gq.uses_mx_kernels(self.qbits, self.group) and gq.uses_mx_kernels(self.qbits, self.value_group(dv))
        if path == "quantized_matmul":
            if not ok:
                raise ValueError(f"attend_path='quantized_matmul' needs MLX layouts (bits in {gq.MX_BITS}, groups in "
                                 f"{gq.MX_GROUPS}); got bits={self.qbits}, key group={self.group}, "
                                 f"value group={self.value_group(dv)}")
            return True
        # auto (docs/RESULTS.md): MLX's CUDA backend has no quantized_matmul for these shapes; on the CPU it beats
        # dequantizing for decode, but its cost grows with the rows (a scalar loop decoding the codes again per
        # row: dequantize + BLAS past QMM_MAX_ROWS). Metal unmeasured, and checked once (``gq.qmm_agrees``: MLX's
        # Metal kernel for this orientation has had bugs).
        if mx.default_device().type != mx.DeviceType.gpu:
            return ok and rows <= QMM_MAX_ROWS
        return (ok and mx.metal.is_available()
                and gq.qmm_agrees(self.qbits, self.group, self.value_group(dv), self.res_k.shape[-1], dv))

    def _store(self, keys, values):
        B, H, N, D = keys.shape
        G, Dv = self.group, values.shape[-1]
        rd = self.res_k.dtype if self.res_k is not None else self._residual_dtype(keys.dtype)
        fresh = lambda: (mx.zeros((B, H, G, D), rd), mx.zeros((B, H, G, Dv), rd))  # noqa: E731
        if self.res_k is None:
            self.res_k, self.res_v = fresh()
        self.dtype_name = dtype_name(keys.dtype)
        q0, r0 = self.n_quant, self.n_res
        past_k, past_v = (self.res_k[:, :, :r0], self.res_v[:, :, :r0]) if r0 else (None, None)
        self._call = (q0, r0, past_k, past_v, keys, values)
        k16, v16 = (x if x.dtype == rd else x.astype(rd) for x in (keys, values))
        nq = 0 if self._holds_back(r0 + N, D, Dv) else (r0 + N) // G * G  # tokens quantized now
        if nq:
            kb = k16 if r0 == 0 else mx.concatenate([past_k, k16], axis=2)
            vb = v16 if r0 == 0 else mx.concatenate([past_v, v16], axis=2)
            self._append_groups(kb[:, :, :nq], vb[:, :, :nq])
            k16, v16, r0 = kb[:, :, nq:], vb[:, :, nq:], 0
            if self.res_k.shape[2] != G:  # held-back rows flushed: back to a G-row residual
                self.res_k, self.res_v = fresh()
        self.res_k = grow_rows(self.res_k, r0, k16)  # past G rows only while ``_holds_back``
        self.res_v = grow_rows(self.res_v, r0, v16)
        self.n_res = r0 + k16.shape[2]

    def _residual_dtype(self, dtype):
        """The residual's dtype for rows of ``dtype``: float16, or the rows' own 2-byte dtype for a class that
        declares ``residual_in_row_dtype`` itself (KIVI: no cast of the rows on every decode step, and bfloat16
        rows keep their range; its variants, which do not declare it, read the residual as float16). The codes
        are the same either way: ``groupquant.quantize`` rounds its input to float16."""
        own = type(self).__dict__.get("residual_in_row_dtype", False)
        return dtype if own and dtype in (mx.float16, mx.bfloat16) else RES_DTYPE

    def _holds_back(self, total: int, d: int, dv: int) -> bool:
        """Whether ``total`` residual rows stay float16 instead of completing groups (variants with
        per-layer fitted constants wait until their compressed form is smaller than the rows)."""
        return False

    def _append_groups(self, kb: mx.array, vb: mx.array) -> None:
        """Quantize ``kb``/``vb`` [B, H, n, D] (n a multiple of G) and append them."""
        kernels._common.RowsMemo.forget(self)
        G, b = self.group, self.qbits
        t0, n = self.n_quant, kb.shape[2]
        kq = gq.quantize_per_channel(kb, b, G)  # codes [B, H, D, (n/G)*w], scales [B, H, D, n/G]
        vq = gq.quantize(vb, b, self.value_group(vb.shape[-1]))  # codes [B, H, n, W], scales [B, H, n, Dv/Gv]
        self._append_codes(t0, kq, vq)
        self.n_quant = t0 + n

    def _append_codes(self, t0: int, kq, vq, vp: str = "v", keys=None) -> None:
        """Write the values' (codes, scales, biases) per token at attribute prefix ``vp`` and the keys' (transposed,
        one column per group; capacity follows the values') for the tokens from ``t0``: ``kq`` at prefix "k", or
        ``keys`` = [(prefix, (codes, scales, biases), words per group)] (variants with several key widths)."""
        for a, x in zip(("codes", "scales", "biases"), vq):
            setattr(self, f"{vp}_{a}", grow_rows(getattr(self, f"{vp}_{a}"), t0, x))
        cap, g0 = getattr(self, f"{vp}_codes").shape[2] // self.group, t0 // self.group
        for kp, q, w in keys if keys is not None else [("k", kq, self._key_words())]:
            for a, x, per in zip(("codes", "scales", "biases"), q, (w, 1, 1)):
                setattr(self, f"{kp}_{a}", grow_columns(getattr(self, f"{kp}_{a}"), g0 * per, x, cap * per))

    def _keys_t(self, n: int, dtype=mx.float32, dequantize=gq.dequantize) -> mx.array:
        """Dequantized K^T [B, H, D, n] of the first ``n`` quantized tokens (``dequantize``: a groupquant reader)."""
        g = n // self.group
        w = self._key_words()
        return dequantize(self.k_codes[..., : g * w], self.k_scales[..., :g], self.k_biases[..., :g],
                          self.qbits, self.group, dtype)

    def _values(self, n: int, dtype=mx.float32, dequantize=gq.dequantize) -> mx.array:
        """Dequantized V [B, H, n, Dv] of the first ``n`` quantized tokens."""
        return dequantize(self.v_codes[:, :, :n], self.v_scales[:, :, :n], self.v_biases[:, :, :n],
                          self.qbits, self.value_group(self.res_v.shape[-1]), dtype)

    def _rows(self, n_quant: int, res_k, res_v, new_k=None, new_v=None, dtype=None):
        """Dense (K, V) of: ``n_quant`` quantized tokens, residual rows, new rows (in order)."""
        quant = self._quantized_rows(n_quant, dtype) if n_quant else (None, None)
        return concat_rows((quant, (res_k, res_v), (new_k, new_v)), dtype)

    def _quantized_rows(self, n: int, dtype=None):
        """Dense (K, V) of the first ``n`` quantized tokens (float32; in ``dtype`` from the CUDA rows kernel);
        their lazy graph is reused between group completions on decode steps whose attention reads the codes:
        the decode kernel's (``kernels.keeps_rows``, ``kernels._common.RowsMemo``) or, elsewhere, ``_attend_codes``
        (``_keeps_rows_on_codes``; a graph built by ``groupquant.dequantize_bytes``, which holds no array of its
        own): rebuilding it is host time (docs/RESULTS.md, "CPU decode of KIVI on two streams")."""
        op = lambda: (self._keys_t(n).swapaxes(-1, -2), self._values(n))  # noqa: E731
        if not self._own_layout():  # a variant storing other arrays: no memo
            return op()
        memo = kernels._common.RowsMemo.of(self)
        out = memo.get(n, self.k_codes)
        if out is None:
            dv = self.res_v.shape[-1]
            rows = self._call[4].shape[2] if self._call else 0
            kernel = (dtype is not None and kernels.kernels_enabled() and self.attend_path == "auto"
                      and kivi_rows.supported(self.qbits, self.group, self.value_group(dv), self.res_k.shape[-1], dv))
            if kernel:
                value, keep = kivi_rows.checked_decode(self, n, dtype, op), kernels.keeps_rows(self, rows)
            elif self._keeps_rows_on_codes(rows):
                value, keep = self._byte_rows(n), True
            else:
                value, keep = op(), kernels.keeps_rows(self, rows)
            out = memo.put(n, self.k_codes, value, keep)
        return out

    def _keeps_rows_on_codes(self, rows: int) -> bool:
        """A decode step off the kernels' backend whose attention is ``_attend_codes`` (dispatch point installed,
        ``attend_path`` "auto"), at a width ``dequantize_bytes`` reads: its dense rows are never evaluated."""
        return (rows == 1 and self.qbits in gq.BYTE_BITS and self.attend_path == "auto" and dispatch.installed()
                and not kernels.kernels_enabled())

    def _byte_rows(self, n: int):
        """``op``'s (K, V) of the first ``n`` quantized tokens as a graph that allocates nothing of its own."""
        return (self._keys_t(n, dequantize=gq.dequantize_bytes).swapaxes(-1, -2),
                self._values(n, dequantize=gq.dequantize_bytes))

    def _own_layout(self) -> bool:
        """Whether this cache stores and reads KIVI's own codes (none of ``_keys_t``/``_values``/``_append_groups``
        overridden); answered once per class (a decode-step check)."""
        cls = type(self)
        if "_own_layout_answer" not in cls.__dict__:
            cls._own_layout_answer = all(getattr(cls, f) is getattr(GroupedQuantCache, f)
                                         for f in ("_keys_t", "_values", "_append_groups"))
        return cls._own_layout_answer

    def _dense(self):
        r = self.n_res
        res = (self.res_k[:, :, :r], self.res_v[:, :, :r]) if r else (None, None)
        return self._rows(self.n_quant, *res, dtype=getattr(mx, self.dtype_name))

    def _fetched(self, dtype):
        q0, _, past_k, past_v, new_k, new_v = self._call
        return self._rows(q0, past_k, past_v, new_k, new_v, dtype=dtype)

    def _short_steps(self) -> bool:
        """Whether a decode row completing no group may skip ``_store``: not for variants storing their own way."""
        return type(self)._store is GroupedQuantCache._store

    def _step_fits(self, step) -> bool:
        """A repeated checked one-row call (``_repeats_checked_step``) that completes no group and fits the residual
        buffer: ``_decode_step`` takes it."""
        r = self.n_res + 1
        return (r < self.group and self.res_k is not None and r <= self.res_k.shape[2]
                and self._repeats_checked_step(step) and self._short_steps())

    def _decode_step(self, keys, values):
        """``update_and_fetch`` of a decode row that completes no group: what ``_check_input`` and ``_store`` do
        for it without their general cases."""
        r0, q0, rk, rv = self.n_res, self.n_quant, self.res_k, self.res_v
        past_k, past_v = (rk[:, :, :r0], rv[:, :, :r0]) if r0 else (None, None)
        self._call = (q0, r0, past_k, past_v, keys, values)
        rd = rk.dtype
        rk[:, :, r0 : r0 + 1] = keys if keys.dtype == rd else keys.astype(rd)
        rv[:, :, r0 : r0 + 1] = values if values.dtype == rd else values.astype(rd)
        self.n_res = r0 + 1
        self.offset += 1
        return self._rows(q0, past_k, past_v, keys, values, dtype=keys.dtype)

    def stored_rows(self) -> int:
        return self.n_quant + self.n_res

    def _take_call(self, queries, keys):
        """This call's record (``_store``) when ``keys`` are the rows ``update_and_fetch`` returned, else None."""
        call, self._call = self._call, None
        N = queries.shape[2]
        if call is None or call[4].shape[2] != N or keys.shape[2] != call[0] + call[1] + N:
            return None
        return call

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        call = self._take_call(queries, keys)
        if call is None:
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        mask = self._own_mask(mask, queries, keys)
        if call[0] + call[1] == 0:  # nothing stored before this call: plain attention over the new rows
            return dense_attention(queries, call[4], call[5], scale=scale, mask=mask, sinks=sinks)
        return self._attend_stored(queries, keys, values, call, scale=scale, mask=mask, sinks=sinks)

    def _cpu_checked(self, queries, call, *, scale, mask, sinks):
        """A decode step on the CPU kernel (``_attend_cpu``), checked once per process against the op path
        (``_attend_codes``); None when ``_cpu_kernel_ready`` refuses this step."""
        new_k, new_v = call[4], call[5]
        if not self._cpu_kernel_ready(mask, new_k.shape[-1], new_v.shape[-1], queries.shape[1] // new_k.shape[1]):
            return None
        return kernels.checked_call(
            f"{self.method_name}_cpu", self, lambda: self._attend_cpu(queries, call, scale=scale, sinks=sinks),
            lambda: self._attend_codes(queries, call, scale=scale, mask=mask, sinks=sinks))

    def _attend_stored(self, queries, keys, values, call, *, scale, mask, sinks):
        """Attention over a stored past: the CUDA decode kernel for a decode step, else ``_attend_codes``; a prefill
        chunk as ``dense_attention`` over the rows ``update_and_fetch`` returned (dequantized once per layer; on the
        CPU in tiles of query rows), or with ``attend_path="quantized_matmul"`` an online softmax over tiles of the
        codes (``_attend_chunk``). SmolLM2, 2048 / 4096 tokens in chunks of 1024 (CPU, session 32): KIVI-4 peaks at
        0.38x / 0.21x the plain cache's in 0.85x / 1.01x its time, against 0.46x / 0.47x and 1.00x / 1.07x in the
        tiles of the codes (tiles dequantize the codes again per tile; MLX's CPU ``quantized_matmul`` decodes them
        again per query row)."""
        N, (q0, _, _, _, new_k, new_v) = queries.shape[2], call
        codes = q0 > self._lead_rows(q0)[0]  # quantized rows before this call (past a variant's lead rows)
        if N == 1 and codes and not self._kernel_off and self._decode_kernel_ready(
                mask, new_k.shape[-1], new_v.shape[-1], queries.shape[1] // new_k.shape[1]):
            self._call = call
            return self._decode_checked(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if N == 1 and codes and not self._kernel_off:
            out = self._cpu_checked(queries, call, scale=scale, mask=mask, sinks=sinks)
            if out is not None:
                return out
        if (self.attend_path == "sdpa" or (N > 1 and self.attend_path != "quantized_matmul")
                or (N == 1 and self._attends_returned_rows())):
            return CompressedKVCache.attend(self, queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if N > 1:
            return self._attend_chunk(queries, call, scale=scale, mask=mask, sinks=sinks)
        return self._attend_codes(queries, call, scale=scale, mask=mask, sinks=sinks)

    def _attends_returned_rows(self) -> bool:
        """Whether a decode step on a GPU attends over the rows ``update_and_fetch`` returned, with MLX's fused
        attention: a variant whose codes are read only through its ``_keys_t`` / ``_values`` (no attention of its
        own on them), where ``_attend_codes`` would build the same decoding a second time. A GPU step is bound by
        the host's graph building (H100, SmolLM2 at 8k: GEAR 0.11x -> 0.36x the plain cache, SKVQ 0.13x -> 0.48x;
        docs/RESULTS.md, "The KIVI-layout variants' decode on a GPU"). Not on the CPU, where the one joint softmax
        over the float32 decoding is faster than MLX's CPU sdpa over the concatenated rows (GEAR 0.34x vs 0.24x)."""
        cls = type(self)
        return (not self._codes_own() and cls._key_scores is GroupedQuantCache._key_scores
                and cls._value_out is GroupedQuantCache._value_out and not blocks.on_cpu())

    def _attend_codes(self, queries, call, *, scale, mask, sinks, weights=False, part=None):
        """The paper's one softmax over [quantized part (``_key_scores``/``_value_out``, or ``part(qf, n)`` ->
        (scores, value_fn)), the past residual rows and the call's rows]; ``call`` = (q0, r0, past_k, past_v, new_k,
        new_v), ``weights`` as in ``joint_attention``."""
        q0, _, past_k, past_v, new_k, new_v = call
        n_keys = q0 + (0 if past_k is None else past_k.shape[2]) + new_k.shape[2]
        return attend_joint(queries, WindowCall(0, *call), None, part or self._codes_part, scale=scale, mask=mask,
                            sinks=sinks, n_keys=n_keys, weights=weights)

    def _attend_cpu(self, queries, call, *, scale, sinks):
        """A decode step by the CPU kernel (``_cpu_part``) over the codes, joined in ``attend_joint`` with the exact
        rows: a variant's lead rows (``_lead_rows``), the residual and the call's row (a string/None mask)."""
        q0, _, past_k, past_v, new_k, new_v = call
        s, lead = self._lead_rows(q0)
        n_keys = q0 + (0 if past_k is None else past_k.shape[2]) + new_k.shape[2]
        return attend_joint(queries, WindowCall(s, q0 - s, *call[1:]), lead, self._cpu_part, scale=scale, mask=None,
                            sinks=sinks, n_keys=n_keys)

    def _lead_rows(self, q0: int):
        """Exact rows stored ahead of the codes among a call's ``q0`` quantized-part rows: (count, (keys, values)
        or None). KIVI has none; ``SinkRows`` (kivi_sink) its float16 sinks."""
        return 0, None

    def _codes_part(self, qf, n: int):
        """``(scores, value_fn)`` of the first ``n`` quantized tokens. A variant that decodes its whole past
        (``_keys_t`` / ``_values`` of its own) builds the values' side (``_value_side``: what does not wait for the
        scores) on a second CPU stream while this one scores the keys, from ``attention.CPU_SPLIT_DECODE_MIN_ROWS``
        rows: MLX runs a CPU stream on one thread."""
        if self._codes_own():
            return self._key_scores(qf, n), lambda p: self._value_out(p, n)
        scores, side = on_cpu_streams([lambda: self._key_scores(qf, n), lambda: self._value_side(n)], n,
                                      attention.CPU_SPLIT_DECODE_MIN_ROWS)
        return scores, lambda p: self._value_out(p, n, side)

    def _key_scores(self, q, n: int) -> mx.array:
        """``q [B, H, R, D] · Q(K)ᵀ`` over the first ``n`` quantized tokens."""
        return self._scores_on_codes(q, 0, n) if self._codes_own() else q @ self._keys_t(n)

    def _value_side(self, n: int) -> mx.array:
        """The values' decoding that ``_value_out`` contracts with the probabilities (a variant's rows)."""
        return self._values(n)

    def _value_out(self, p, n: int, side=None) -> mx.array:
        """``p [B, H, R, n] · Q(V)`` over the first ``n`` quantized tokens (``side``: ``_value_side(n)``, built)."""
        if side is None and self._codes_own():
            return self._values_on_codes(p, 0, n)
        return p @ (self._value_side(n) if side is None else side)

    def _codes_own(self) -> bool:
        """Whether the stored codes are KIVI's own (not redefined by a variant's ``_keys_t``/``_values``)."""
        cls = type(self)
        return cls._keys_t is GroupedQuantCache._keys_t and cls._values is GroupedQuantCache._values

    def _scores_on_codes(self, q, t0: int, t1: int) -> mx.array:
        """``q · Q(K)ᵀ`` for quantized tokens ``t0 .. t1`` (whole groups): ``quantized_matmul`` on the
        transposed per-channel codes where ``_uses_qmm``, else the codes dequantized to float32."""
        G, b, w = self.group, self.qbits, self._key_words()
        g0, g1 = t0 // G, t1 // G
        codes, sc, bi = self.k_codes[..., g0 * w : g1 * w], self.k_scales[..., g0:g1], self.k_biases[..., g0:g1]
        if self._uses_qmm(q.shape[-2]):
            qmm = lambda x, c, s, z: mx.quantized_matmul(x, c, s, z, transpose=False, group_size=G, bits=b)  # noqa
            return split_on_cpu_streams(cpu_parts(t1 - t0, q.shape[-1], qmm, (q, -1), (codes, 2), (sc, 2), (bi, 2)))
        return q @ gq.dequantize(codes, sc, bi, b, G, mx.float32)

    def _values_on_codes(self, p, t0: int, t1: int) -> mx.array:
        """``p · Q(V)`` for quantized tokens ``t0 .. t1``."""
        gv, b = self.value_group(self.res_v.shape[-1]), self.qbits
        codes, sc, bi = self.v_codes[:, :, t0:t1], self.v_scales[:, :, t0:t1], self.v_biases[:, :, t0:t1]
        if self._uses_qmm(p.shape[-2]):
            qmm = lambda x, c, s, z: mx.quantized_matmul(x, c, s, z, transpose=False, group_size=gv, bits=b)  # noqa
            return split_on_cpu_streams(cpu_parts(t1 - t0, t1 - t0, qmm, (p, -1), (codes, 2), (sc, 2), (bi, 2)))
        return p @ gq.dequantize(codes, sc, bi, b, gv, mx.float32)

    def _attend_chunk(self, queries, call, *, scale, mask, sinks):
        """A multi-row call as an online softmax over tiles of whole groups (``attention.online_softmax_attention``):
        tiles of 1/16 of the [N, M] scores, so a prefill chunk's transients stay below the plain cache's."""
        return attend_tiled(queries, WindowCall(0, *call), None, self._quantized_tiles, scale=scale, mask=mask,
                            sinks=sinks, n_keys=call[0] + call[1] + queries.shape[2], block=self.group)

    def _quantized_tiles(self, q, ranges):
        """(scores_fn, values_fn) per range of quantized rows (whole groups), on the codes; variants with their
        own ``_keys_t`` / ``_values`` decode their rows once and are tiled from those."""
        if not self._codes_own():
            n = ranges[-1][1]
            kt, vv = self._keys_t(n), self._values(n)
            return [(lambda a=a, c=c: q @ kt[..., a:c], lambda p, a=a, c=c: p @ vv[:, :, a:c]) for a, c in ranges]
        return [(lambda a=a, c=c: self._scores_on_codes(q, a, c), lambda p, a=a, c=c: self._values_on_codes(p, a, c))
                for a, c in ranges]

    def _decode_kernel_ready(self, mask, d: int, dv: int, rep: int = 1) -> bool:
        """One query row over KIVI's own layout, a string/None mask, a layout the kernel reads, CUDA."""
        return ((self._own_layout() or self.own_codes_after_lead_rows) and isinstance(mask, (str, type(None)))
                and self.attend_path == "auto"
                and kivi_kernel.supported(self.qbits, self.group, self.value_group(dv), d, dv, rep)
                and (kernels.kernels_enabled() or kernels.metal_enabled()))

    def _cpu_kernel_ready(self, mask, d: int, dv: int, rep: int) -> bool:
        """A decode step the CPU kernel (``native``) takes: a layout ``_cpu_part`` reads (``_cpu_layout``), a
        string/None mask and ``_cpu_codes_fit``."""
        return self._cpu_layout() and isinstance(mask, (str, type(None))) and self._cpu_codes_fit(d, dv, rep)

    def _cpu_layout(self) -> bool:
        """Whether ``_cpu_part`` reads this cache's codes: KIVI's own layout (after lead rows), or a variant's own
        ``_cpu_part`` over several KIVI-layout stores (age_tiered's tiers, Kitty's two key widths)."""
        return self._own_layout() or self.own_codes_after_lead_rows

    def _cpu_codes_fit(self, d: int, dv: int, rep: int) -> bool:
        """Codes the CPU kernel reads: kernels built, ``attend_path`` "auto", 2/4/8-bit codes, groups of 32k tokens,
        value groups of at least 8 channels, head dims up to 256, up to 32 query heads per KV head."""
        return (native.available() and self.attend_path == "auto" and self.qbits in (2, 4, 8) and self.group % 32 == 0
                and self.value_group(dv) % 8 == 0 and max(d, dv) <= 256 and rep <= 32)

    def _cpu_part(self, qf, n: int, counts=()) -> Partials:
        """The first ``n`` quantized tokens' partials by the CPU kernel (``native/kivi_cpu.cpp``'s
        ``kivi_decode``: each block of 64 tokens' codes read once, scored and summed in one pass); a batch form's
        ``counts``: sequence b's first ``counts[b]`` tokens."""
        return self._cpu_store_part(qf, "", self.qbits, n, counts)

    def _cpu_store_part(self, qf, tag: str, bits: int, n: int, counts=()) -> Partials:
        """``kivi_decode`` over the first ``n`` tokens of the KIVI-layout store ``k{tag}_*`` / ``v{tag}_*`` (KIVI's
        own: ``tag`` ""; age_tiered's tiers: "0" .. "2") holding ``bits``-bit codes."""
        dv = self.res_v.shape[-1]
        arrays = [getattr(self, f"{kv}{tag}_{a}") for kv in "kv" for a in ("codes", "scales", "biases")]
        m, l, acc = native.module().kivi_decode(  # noqa: E741
            qf, *arrays, n, bits, self.group, self.value_group(dv), dv, counts=list(counts))
        return Partials(m, l, acc)

    def _decode_attend(self, queries, *, scale, sinks=None):
        """One query row: the decode kernel's split-K partials over the codes plus the residual and the call's own
        row, merged in one softmax by the launch's last block per head (past ``FUSED_MAX_S1`` partials by a
        second launch: ``kernels._common.launch``)."""
        call, self._call = self._call, None
        q0, r0, past_k, past_v, new_k, new_v = call
        s, lead = self._lead_rows(q0)  # a variant's exact rows ahead of the codes (kivi_sink's sinks)
        # the residual buffer holds the past rows first, unless this call completed a group: then the record's
        res_k, res_v = (past_k, past_v) if self.n_quant + s != q0 and r0 else (self.res_k, self.res_v)
        exact = (*lead, s, res_k, res_v, r0, new_k, new_v) if s else (res_k, res_v, r0, res_k, res_v, 0, new_k, new_v)
        return kivi_kernel.kivi_partials(queries, scale, self.k_codes, self.k_scales, self.k_biases, self.v_codes,
                                         self.v_scales, self.v_biases, q0 - s, self.qbits, self.group,
                                         self.value_group(new_v.shape[-1]), exact,
                                         merge=kernels.Merge(sinks, False, queries.dtype, self))

    def _decode_checked(self, queries, keys, values, *, scale, mask, sinks):
        """The kernel path, checked once per process against the op path (``kernels.checked_call``)."""
        def op_attend():
            self._kernel_off = True
            try:
                return self.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            finally:
                self._kernel_off = False
        return kernels.checked_call(self.method_name, self, lambda: self._decode_attend(queries, scale=scale,
                                                                                          sinks=sinks),
                                    op_attend)

    def _check_trim_rows(self, n: int) -> None:
        """Exact trims only: the ``n`` newest tokens must be residual tokens plus whole groups, and not part (all
        of it or none) of a variant's fitted block (``calib_field``)."""
        self._check_stored(n, self.stored_rows())
        extra, G = n - self.n_res, self.group
        if extra <= 0:
            return
        if extra % G:
            keep = self.n_quant - (extra // G + 1) * G
            raise ValueError(self.cut_group_text.format(cls=type(self).__name__, n=n, G=G, first=keep,
                                                        last=keep + G - 1, bits=self.qbits, res=self.n_res))
        calib_end = getattr(self._fit_holder, self.calib_field) if self.calib_field else 0
        if 0 < self.n_quant - extra < calib_end:
            raise ValueError(f"{type(self).__name__}: trimming {n} tokens would remove part of the first {calib_end} "
                             "coded tokens, whose statistics made the remaining codes; the result would differ from "
                             "never having seen them")

    def _trim_rows(self, n: int) -> int:
        """The residual's newest rows, then whole groups; emptying the codes resets the fit (as a fresh cache)."""
        kernels._common.RowsMemo.forget(self)
        if n <= self.n_res:
            self.n_res -= n
            return n
        self.n_quant -= n - self.n_res
        self.n_res = 0
        if self.n_quant == 0 and self.calib_field and self._fit_holder is self:  # fit again, as a fresh cache would
            for name in (self.calib_field, *self.refit_fields):
                setattr(self, name, getattr(type(self), name, None))  # the class default (None: an array)
        return n

    @property
    def used_nbytes(self) -> int:
        """Bytes of the quantized tokens (``_code_nbytes``) and the residual buffers (no spare capacity)."""
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        return self._code_nbytes(B, H, D, self.res_v.shape[-1]) + self.res_k.nbytes + self.res_v.nbytes

    def _code_nbytes(self, B: int, H: int, D: int, dv: int) -> int:
        """Bytes of the ``n_quant`` quantized tokens: codes and float16 scales/biases of keys and values."""
        key = B * H * D * (self.n_quant // self.group) * (4 * self._key_words() + 2 * 2)
        return key + self._value_code_nbytes(B, H, dv)

    def _value_code_nbytes(self, B: int, H: int, dv: int) -> int:
        """Bytes of the ``n_quant`` tokens' per-token value codes and float16 scales/biases."""
        gv = self.value_group(dv)
        return B * H * self.n_quant * (dv // gv) * (4 * gq.words_per_group(self.qbits, gv) + 2 * 2)

    full_seq_bytes = property(lambda self: fp16_row_bytes(self.res_k, self.res_v, self.offset))

    @property
    def fp16_key_bytes(self) -> int:
        """The keys' share of ``full_seq_bytes``."""
        if self.res_k is None:
            return 0
        B, H, _, D = self.res_k.shape
        return B * H * self.offset * D * 2

    fp16_value_bytes = property(lambda self: self.full_seq_bytes - self.fp16_key_bytes)
