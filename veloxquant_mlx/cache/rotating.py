"""Sliding-window layers compressed: mlx_lm's ``RotatingKVCache`` ring with every slot holding codes.

Sliding-window models (Gemma 2/3, Ministral, gpt-oss) give those layers a ``RotatingKVCache``: ``max_size``
slots (the first ``keep`` stay put) filled in place while decoding; a multi-row call reorders them and keeps
``max_size + S - 1`` rows. ``RotatingQuantKVCache`` runs mlx_lm's own ring code on each code array (row axis
= slot axis), so slots, ``offset``, masks and the trim rule are RotatingKVCache's; ``update_and_fetch``
returns the dequantized rows in slot order, ``attend`` uses the model's mask and sinks. A slot is rewritten
one row at a time, so only per-token codes fit:

* ``kivi``: keys *and* values per token, ``b``-bit group-affine in channel groups of ``gcd(D, G)``.
  Deviation from KIVI: keys are not per channel over G tokens, and there is no float16 residual.
* ``waterfill``: keys as kivi's ring, values as waterfill's (Hadamard-rotated, per-row float16 RMS, ``b``-bit
  Gaussian odd-polynomial codebook). Deviation: no query-weighted key widths, no pre-RoPE ranges, no
  float16 sinks or window. A non-power-of-two ``Dv`` rotates by waterfill's seeded matrix, a per-process
  constant the ring does not count.

A call's attention equals RotatingKVCache's fed the dequantized rows (``tests/test_rotating.py``); dense rows
are decoded per call, never held; ``nbytes`` is the code arrays, spare slots included. Bytes per row and KV
head at ``b = 4``, ``D = Dv = 64``, ``G = 32``: kivi 80, waterfill 74, float16 256.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .contract import CompressedKVCache, register_with_mlx_lm
from .errors import QuantizerConfigError
from .options import _is_int
from .primitives import groupquant as gq
from .primitives.bitpack import pack_bits, unpack_bits
from .primitives.buffers import dtype_name
from .primitives.codebook import nearest_code, odd_poly_gaussian
from .primitives.value_rotation import odd_poly, poly_coefficients, rotate_values

_RING = mlx_cache.RotatingKVCache


class RotatingQuantKVCache(CompressedKVCache):
    """A ``RotatingKVCache`` ring of per-token codes (module docstring). Subclasses name their code arrays
    (``array_fields``: rows on axis 2, 4-D): the keys' affine codes, scales and biases, then the values' (affine
    too unless ``_encode_values(values) -> [arrays]`` and ``_decode_values(arrays, Dv, dtype)`` say otherwise)."""

    chunk_invariant = False  # as RotatingKVCache (a multi-row call keeps max_size + S - 1 rows)
    exact_trim = False  # as RotatingKVCache: only while offset < max_size; rotated rows are gone
    scalar_fields = ("keep", "max_size", "_idx", "dtype_name")
    step = _RING.step
    dtype_name = "float32"

    # mlx_lm's ring, run on our arrays (they read only keep / max_size / offset / _idx)
    _trim = _RING._trim
    _temporal_order = _RING._temporal_order
    make_mask = _RING.make_mask
    size = _RING.size
    is_trimmable = _RING.is_trimmable
    trim = _RING.trim

    def __init__(self, config, max_size: int, keep: int = 0):
        self.max_size, self.keep, self._idx = int(max_size), int(keep), 0
        super().__init__(config)

    def _init_layout(self):
        b = self.config.bit_width_inlier
        if not _is_int(b):  # a per-layer list: for_model gives each layer its own
            raise QuantizerConfigError("bit_width_inlier", b,
                                       f"an int in 1..8 for a sliding-window layer of {self.config.method!r}")
        # ``qbits``, not ``bits``: mlx_lm routes caches with ``bits`` to its own kernel
        self.qbits, self.group = b, getattr(self.config.options, "group_size", 32)

    def _affine(self, x):
        return list(gq.quantize(x, self.qbits, math.gcd(x.shape[-1], self.group)))

    def _unaffine(self, arrays, dim, dtype):
        return gq.dequantize(*arrays, self.qbits, math.gcd(dim, self.group), dtype)

    _encode_values, _decode_values = _affine, _unaffine

    def _encode(self, keys, values):
        return self._affine(keys) + self._encode_values(values)

    def _decode(self, a, dtype):
        _, D, Dv = self._shape
        return self._unaffine(a[:3], D, dtype), self._decode_values(a[3:], Dv, dtype)

    def _arrays(self) -> list:
        return [getattr(self, n) for n in self.array_fields]

    def _put(self, arrays) -> None:
        self.__dict__.update(zip(self.array_fields, arrays))

    def update_and_fetch(self, keys, values):
        self._check_input(keys, values)
        self.dtype_name = dtype_name(keys.dtype)
        rows, S, ring = self._encode(keys, values), keys.shape[2], self._arrays()
        if S > 1:  # RotatingKVCache._update_concat, over every code array
            if ring[0] is not None:
                ring = [self._temporal_order(a) for a in ring]
                self._idx = ring[0].shape[2]
                trim_size = self._idx - self.max_size + 1
                rows = [self._trim(trim_size, a, r) for a, r in zip(ring, rows)]
            self._put(rows)
        else:  # _update_in_place
            prev = self.offset
            if ring[0] is None or (prev >= ring[0].shape[2] and ring[0].shape[2] < self.max_size):
                new = min(self.step, self.max_size - prev)
                grown = [mx.zeros((*r.shape[:2], new, r.shape[3]), r.dtype) for r in rows]
                ring = grown if ring[0] is None else [mx.concatenate([a, g], axis=2) for a, g in zip(ring, grown)]
                self._idx = prev
            if ring[0].shape[2] > self.max_size:
                ring = [self._trim(ring[0].shape[2] - self.max_size, a) for a in ring]
                self._idx = self.max_size
            if self._idx == self.max_size:
                self._idx = self.keep
            for a, r in zip(ring, rows):
                a[..., self._idx : self._idx + S, :] = r
            self._put(ring)
        self.offset += S
        self._idx = self._idx + S if S == 1 else ring_rows(self)
        return self._dense()

    def _dense(self):
        """Dequantized rows in RotatingKVCache's order (``keys_and_values``), in the model's dtype."""
        n = self.stored_rows()
        arrays = [a if n == a.shape[2] else a[..., :n, :] for a in self._arrays()]
        return self._decode(arrays, getattr(mx, self.dtype_name))

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        """Attention over the decoded window with mlx_lm's mask as given (it was built for this ring)."""
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def _set_state(self, v):
        """As the base's, then the ring's own numbers checked (a forged file must not place rows wrongly)."""
        CompressedKVCache.state.fset(self, v)
        rows = {a.shape[2] for a in self._arrays() if a is not None}
        n = max(rows, default=0)
        ints = all(map(_is_int, (self.max_size, self.keep, self._idx)))
        if not (ints and len(rows) <= 1 and 0 <= self.keep < self.max_size and 0 <= self._idx <= n
                and 0 <= min(self.offset, self.max_size) <= n):
            raise ValueError(f"{type(self).__name__} state: keep={self.keep!r}, max_size={self.max_size!r}, "
                             f"_idx={self._idx!r}, offset={self.offset!r} do not fit {sorted(rows)} ring rows")

    state = property(CompressedKVCache.state.fget, _set_state)

    def stored_rows(self) -> int:
        """Rows ``update_and_fetch`` returns: up to ``max_size + S - 1`` after a multi-row call (``size()``
        is RotatingKVCache's ``min(offset, max_size)``)."""
        return min(self.offset, ring_rows(self))

    def empty(self) -> bool:
        return self._arrays()[0] is None


def ring_rows(cache) -> int:
    """Slots of the ring buffer (0 before the first call)."""
    return 0 if (a := cache._arrays()[0]) is None else a.shape[2]


@register_with_mlx_lm
class RotatingKIVICache(RotatingQuantKVCache):
    """kivi on a sliding-window layer: keys and values per token, b-bit groups of gcd(D, G) channels."""

    method_name = "kivi"
    array_fields = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")


@register_with_mlx_lm
class RotatingWaterfillCache(RotatingQuantKVCache):
    """waterfill on a sliding-window layer: per-token affine keys, waterfill's rotated codebook values."""

    method_name = "waterfill"
    array_fields = ("k_codes", "k_scales", "k_biases", "v_words", "v_scales")

    def _encode_values(self, values):
        y = rotate_values(values.astype(mx.float32), int(self.config.seed))
        s = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True)).astype(mx.float16)  # [B, H, n, 1]
        codes = nearest_code(y / mx.maximum(s.astype(mx.float32), 1e-30), odd_poly_gaussian(self.qbits)[0])
        return [pack_bits(codes, self.qbits), s]

    def _decode_values(self, a, Dv, dtype):
        u = odd_poly(unpack_bits(a[0], self.qbits, Dv), (1 << self.qbits) - 1, *poly_coefficients(self.qbits))
        return rotate_values(u * a[1].astype(mx.float32), int(self.config.seed), inverse=True).astype(dtype)


#: method -> its ring class; a quantizer not listed keeps mlx_lm's RotatingKVCache on sliding layers
RING_CLASSES = {"kivi": RotatingKIVICache, "waterfill": RotatingWaterfillCache}
