"""Group-affine (min/max) scalar quantization, the shared primitive of the scalar quantizers: along the last axis
every ``group`` elements share a float16 scale ``s = (max - min) / (2^bits - 1)`` and bias ``z = min``; an element
is the code ``round((x - z) / s)``, read back as ``c * s + z``. Codes are ``uint32`` words, each group owning whole
words, so blocks of whole groups append. ``(bits, group)`` alone picks the kernel: MLX's ``mx.quantize`` (input cast
to float16; the layout ``mx.quantized_matmul`` reads) for bits in ``MX_BITS`` and groups in ``MX_GROUPS``, else the
same rule on ``bitpack`` rows. Per-channel quantization (KIVI keys) quantizes the transposed block ``[..., D, T]``
along ``T``, which ``quantized_matmul(q, codes, transpose=False)`` reads as ``q @ K^T``.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import mlx.core as mx

from . import check_int
from .bitpack import pack_bits, packed_words, unpack_bits
from .blocks import on_cpu
from .fused import elementwise

MX_BITS = (2, 3, 4, 5, 6, 8)
MX_GROUPS = (32, 64, 128)
SCALE_DTYPE = mx.float16


class GroupQuantized(NamedTuple):
    codes: mx.array  # uint32 words
    scales: mx.array  # float16, one per group
    biases: mx.array


def uses_mx_kernels(bits: int, group: int) -> bool:
    """Whether ``(bits, group)`` uses MLX's own layout (and so ``mx.quantized_matmul`` applies)."""
    return check_int("bits", bits, 1, 8) in MX_BITS and check_int("group", group, 1) in MX_GROUPS


def words_per_group(bits: int, group: int) -> int:
    """uint32 words holding the codes of one group."""
    return packed_words(check_int("group", group, 1), bits)


def group_bytes_per_element(bits: int, group: int) -> float:
    """Bytes per quantized element: the group's code words plus its float16 scale and bias."""
    return (4 * words_per_group(bits, group) + 2 * SCALE_DTYPE.size) / group


def quantize(x: mx.array, bits: int, group: int, reference: bool = False) -> GroupQuantized:
    """Quantize ``x [..., n]`` along its last axis in groups of ``group`` (``n % group == 0``). ``reference``:
    the min/max rule on the float32 input whatever ``(bits, group)`` (MLX's kernel rounds the input to
    float16 and shifts its levels to hold zero: up to 0.89 step at 8 bits); ``dequantize`` reads either."""
    n, lead = x.shape[-1], x.shape[:-1]
    if n % group:
        raise ValueError(f"last axis {n} is not a multiple of group={group}")
    if uses_mx_kernels(bits, group) and not reference:
        # row-major first: MLX 0.32.4's CUDA quantize reads a transposed lone matrix (leading dims all 1, e.g. one
        # KV head's per-channel keys) as if it were row-major (tests/test_primitives.py, seen on an H200)
        codes, scales, biases = mx.quantize(mx.contiguous(x.astype(SCALE_DTYPE)), group_size=group, bits=bits)
        return GroupQuantized(codes, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE))
    xg = x.astype(mx.float32).reshape(*lead, n // group, group)
    lo = xg.min(axis=-1, keepdims=True)
    scales = ((xg.max(axis=-1, keepdims=True) - lo) / float(2**bits - 1)).astype(SCALE_DTYPE)
    biases = lo.astype(SCALE_DTYPE)
    q = affine_codes(xg, biases.astype(mx.float32), scales.astype(mx.float32), bits)
    return GroupQuantized(pack_bits(q, bits).reshape(*lead, -1), scales[..., 0], biases[..., 0])


def affine_codes(x: mx.array, lo: mx.array, step: mx.array, bits: int) -> mx.array:
    """The min/max rule's ``uint32`` codes ``round((x - lo) / step)`` in ``[0, 2^bits - 1]`` (float32 operands,
    broadcast; a zero step reads as 1), shared by the quantizers that keep their own ranges."""
    q = mx.round((x - lo) / mx.where(step > 0, step, 1.0))
    return mx.clip(q, 0.0, float(2**bits - 1)).astype(mx.uint32)


@elementwise
def _affine(q: mx.array, s: mx.array, b: mx.array) -> mx.array:
    return q.astype(s.dtype) * s + b


def dequantize(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int,
               dtype=mx.float32) -> mx.array:
    """``[..., n]`` values in ``dtype`` from what ``quantize`` returned (any leading slice of groups). MLX's
    ``mx.dequantize`` on a GPU; on the CPU ``bitpack``'s unpacking and one fused affine pass read MLX's layout too,
    2-5x faster than MLX's CPU kernel there (3-bit codes 5.9 -> 1.6 ms for SmolLM2's 4096 x 3 x 64 values)."""
    s, b = scales.astype(dtype), biases.astype(dtype)
    if uses_mx_kernels(bits, group) and not on_cpu():
        return mx.dequantize(codes, s, b, group_size=group, bits=bits)
    lead, ng = codes.shape[:-1], scales.shape[-1]
    q = unpack_bits(codes.reshape(*lead, ng, -1), bits, group)
    return _affine(q, s[..., None], b[..., None]).reshape(*lead, ng * group)


BYTE_BITS = (2, 4, 8)  # widths whose codes never straddle a byte: read with a byte view, shifts and a mask
_BYTE_SHIFTS: dict = {}


def dequantize_bytes(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int,
                     dtype=mx.float32) -> mx.array:
    """:func:`dequantize` for ``bits`` in ``BYTE_BITS`` (either layout: both put code ``j`` of a group at its words'
    stream bits ``j * bits ..``), built without allocating anything: its shifts and mask are process-wide arrays
    (MLX's ``dequantize`` allocates 64 bytes of its own at each call). For a lazy graph kept between decode steps
    (``kernels._common.RowsMemo``), which then holds nothing beyond the cache's own arrays."""
    if bits not in BYTE_BITS:
        raise ValueError(f"bits must be one of {BYTE_BITS}, got {bits}")
    if bits not in _BYTE_SHIFTS:
        _BYTE_SHIFTS[bits] = (mx.arange(0, 8, bits, dtype=mx.uint8), mx.array((1 << bits) - 1, mx.uint8))
        mx.eval(_BYTE_SHIFTS[bits])
    shifts, mask = _BYTE_SHIFTS[bits]
    lead, ng = codes.shape[:-1], scales.shape[-1]
    b = mx.view(codes.reshape(*lead, ng, -1), mx.uint8)  # [.., groups, bytes of a group's words]
    q = (mx.right_shift(b[..., None], shifts) & mask).reshape(*lead, ng, -1)[..., :group].astype(dtype)
    return (q * scales.astype(dtype)[..., None] + biases.astype(dtype)[..., None]).reshape(*lead, ng * group)


def quantize_per_channel(x: mx.array, bits: int, group: int) -> GroupQuantized:
    """Each channel of ``x [..., T, D]`` in groups of ``group`` tokens: codes ``[..., D, (T/group)*words]``,
    scales and biases ``[..., D, T/group]``."""
    return quantize(x.swapaxes(-1, -2), bits, group)


def dequantize_per_channel(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int,
                           dtype=mx.float32, transposed: bool = False) -> mx.array:
    """``[..., T, D]`` (or ``[..., D, T]`` with ``transposed=True``) from ``quantize_per_channel``."""
    kt = dequantize(codes, scales, biases, bits, group, dtype)
    return kt if transposed else kt.swapaxes(-1, -2)


QMM_CHECK_TOKENS = 2048  # past 1024 contraction rows MLX's Metal kernel takes its split-K path (mlx#4250)
QMM_CHECK_TOL = 1e-2  # relative L2: the same sums in another order are ~1e-6 off, the known bugs ~1


@functools.cache
def qmm_agrees(bits: int, group: int, value_group: int, d: int, dv: int) -> bool:
    """Whether ``mx.quantized_matmul(transpose=False)`` on the default device computes what dequantize + matmul
    computes for KIVI's two contractions (scores ``q [3, d] @ K^T`` over per-channel key codes, the weighted sum ``p
    [3, T] @ V`` over per-token value codes), checked once per process and shape on random rows. MLX's Metal
    kernels have returned zeros or garbage on exactly this path (ml-explore/mlx#4250: split-K with an output not a
    multiple of 64 columns, e.g. a head dim of 80 or 96; #4201), which the MLX a user has installed may carry; on
    a mismatch one warning names it and the caller dequantizes instead."""
    T = QMM_CHECK_TOKENS
    keys, values, q, p = (mx.random.normal(s, key=mx.random.key(i))
                          for i, s in enumerate([(d, T), (T, dv), (3, d), (3, T)]))
    kq, vq = quantize(keys, bits, group), quantize(values, bits, value_group)
    pairs = [(mx.quantized_matmul(x, *c, transpose=False, group_size=g, bits=bits), x @ dequantize(*c, bits, g))
             for x, c, g in ((q, kq, group), (p, vq, value_group))]
    err = max(float(mx.linalg.norm(got - want) / mx.linalg.norm(want)) for got, want in pairs)
    if err < QMM_CHECK_TOL:
        return True
    warnings.warn(f"veloxquant: mx.quantized_matmul(transpose=False) on {mx.default_device()} disagrees with "
                  f"dequantize + matmul (relative error {err:.2g} at bits={bits}, groups {group}/{value_group}, "
                  f"head dims {d}/{dv}; known MLX bugs ml-explore/mlx#4250 and #4201): KIVI-layout caches "
                  "dequantize instead (slower; a newer MLX may fix it)", RuntimeWarning, stacklevel=2)
    return False
