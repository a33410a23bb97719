"""Group-affine (asymmetric min/max) scalar quantization: the shared primitive of the scalar quantizers.

Along the last axis, every ``group`` consecutive elements share one scale ``s`` and one bias ``z``
(``z`` = group minimum, ``s`` = (max - min) / (2^bits - 1)); an element is stored as the ``bits``-bit
code ``c = round((x - z) / s)`` and read back as ``c * s + z``.

Storage (whatever the compute dtype):

* ``codes``: ``uint32`` words, ``[..., n_groups * words_per_group(bits, group)]``. Every group owns
  whole words (``ceil(group * bits / 32)`` of them), so quantizing a block of whole groups and writing
  its words next to earlier ones is the same as quantizing the concatenation: callers can append
  groups to a preallocated buffer.
* ``scales``, ``biases``: ``float16``, ``[..., n_groups]`` (2 + 2 bytes per group), so the bit budget is
  ``group_bytes_per_element(bits, group)`` bytes per element whatever dtype the model computes in.

Two interchangeable kernels, chosen from ``(bits, group)`` alone so that ``dequantize`` always matches
``quantize``:

* ``bits in {2, 3, 4, 5, 6, 8}`` and ``group in {32, 64, 128}``: MLX's ``mx.quantize`` /
  ``mx.dequantize`` (the input is cast to float16 first, so the float16 scales/biases are the ones the
  codes were computed with). Only this layout can be fed to ``mx.quantized_matmul``
  (``uses_mx_kernels``).
* anything else (bits 1..8, any group >= 1, e.g. a 16-channel head): a vectorized MLX reference
  kernel with the same min/max rule; each group's codes are one ``bitpack`` row (little-endian: code
  ``j`` at stream bits ``[j*bits, (j+1)*bits)``, stream bit ``p`` = bit ``p % 32`` of word ``p // 32``).

Per-channel quantization (KIVI keys: each channel, groups of ``group`` consecutive tokens) is the same
operation on the transposed block: ``quantize_per_channel`` takes ``[..., T, D]`` and stores the codes
of ``[..., D, T]`` quantized along ``T`` (the layout ``mx.quantized_matmul(q, codes, ...,
transpose=False)`` multiplies as ``q @ K^T``).

Everything is vectorized MLX: no Python loop over tokens, channels, heads or groups.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .bitpack import pack_bits, unpack_bits

__all__ = [
    "MX_BITS",
    "MX_GROUPS",
    "SCALE_DTYPE",
    "GroupQuantized",
    "uses_mx_kernels",
    "words_per_group",
    "group_bytes_per_element",
    "quantize",
    "dequantize",
    "quantize_per_channel",
    "dequantize_per_channel",
]

MX_BITS = (2, 3, 4, 5, 6, 8)
MX_GROUPS = (32, 64, 128)
SCALE_DTYPE = mx.float16


class GroupQuantized(NamedTuple):
    """Packed codes (uint32) and float16 per-group scales and biases."""

    codes: mx.array
    scales: mx.array
    biases: mx.array


def _check(bits: int, group: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is invalid: expected an int in 1..8")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group={group!r} is invalid: expected a positive int")


def uses_mx_kernels(bits: int, group: int) -> bool:
    """Whether ``(bits, group)`` uses MLX's own layout (and so ``mx.quantized_matmul`` applies)."""
    _check(bits, group)
    return bits in MX_BITS and group in MX_GROUPS


def words_per_group(bits: int, group: int) -> int:
    """uint32 words holding the codes of one group."""
    _check(bits, group)
    return (group * bits + 31) // 32


def group_bytes_per_element(bits: int, group: int) -> float:
    """Bytes per quantized element: the group's code words plus its float16 scale and bias."""
    return (4 * words_per_group(bits, group) + 2 * SCALE_DTYPE.size) / group


# ---------------------------------------------------------------------------------------- kernels
def quantize(x: mx.array, bits: int, group: int, reference: bool = False) -> GroupQuantized:
    """Quantize ``x [..., n]`` along its last axis in groups of ``group`` (``n % group == 0``).
    ``reference``: the min/max rule on the float32 input whatever ``(bits, group)`` (MLX's kernel rounds
    the input to float16 and shifts its levels to hold zero: measured up to 0.89 step at 8 bits); both layouts are the
    same bit stream, so ``dequantize`` reads either."""
    _check(bits, group)
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"last axis {n} is not a multiple of group={group}")
    lead = x.shape[:-1]
    if uses_mx_kernels(bits, group) and not reference:
        codes, scales, biases = mx.quantize(x.astype(SCALE_DTYPE), group_size=group, bits=bits)
        return GroupQuantized(codes, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE))
    ng = n // group
    xg = x.astype(mx.float32).reshape(*lead, ng, group)
    lo = xg.min(axis=-1, keepdims=True)
    hi = xg.max(axis=-1, keepdims=True)
    levels = float(2**bits - 1)
    scales = ((hi - lo) / levels).astype(SCALE_DTYPE)
    biases = lo.astype(SCALE_DTYPE)
    s = scales.astype(mx.float32)
    q = mx.round((xg - biases.astype(mx.float32)) / mx.where(s > 0, s, 1.0))
    q = mx.clip(q, 0.0, levels).astype(mx.uint32)
    words = pack_bits(q, bits)  # [..., ng, wpg]
    return GroupQuantized(words.reshape(*lead, -1), scales[..., 0], biases[..., 0])


def dequantize(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int,
               dtype=mx.float32) -> mx.array:
    """``[..., n]`` values in ``dtype`` from what ``quantize`` returned (any leading slice of groups)."""
    _check(bits, group)
    s, b = scales.astype(dtype), biases.astype(dtype)
    if uses_mx_kernels(bits, group):
        return mx.dequantize(codes, s, b, group_size=group, bits=bits)
    lead = codes.shape[:-1]
    ng = scales.shape[-1]
    q = unpack_bits(codes.reshape(*lead, ng, -1), bits, group).astype(dtype)
    return (q * s[..., None] + b[..., None]).reshape(*lead, ng * group)


def quantize_per_channel(x: mx.array, bits: int, group: int) -> GroupQuantized:
    """Per-channel quantization of ``x [..., T, D]``: each channel, groups of ``group`` consecutive
    tokens. Returns the codes of the transposed block: ``codes [..., D, (T/group)*wpg]``,
    ``scales``/``biases`` ``[..., D, T/group]``."""
    return quantize(x.swapaxes(-1, -2), bits, group)


def dequantize_per_channel(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int,
                           dtype=mx.float32, transposed: bool = False) -> mx.array:
    """``[..., T, D]`` (or ``[..., D, T]`` with ``transposed=True``) from ``quantize_per_channel``."""
    kt = dequantize(codes, scales, biases, bits, group, dtype)
    return kt if transposed else kt.swapaxes(-1, -2)
