"""PolarQuant standalone single-head cache ("polar"; Han, Kacham, Karbasi, Mirrokni, Zandieh; arXiv 2502.02617).

A key is rotated by a seeded Haar-random ``Pi`` (``config.store`` key ``polar.rotation.d<d>.seed<seed>``; its
angles then follow known laws) and turned by a recursive polar transform over ``L`` levels (``primitives.polar``)
into float16 radii and angles, coded with each level's MSE-optimal codebook (no per-block scale or zero point, the
paper's point). Scores ``<Pi q, y_hat>`` come from cos/sin tables. Bits: ``b = bit_width_inlier`` at level 1
(range ``2*pi``), ``max(1, b - 2)`` above: ``b = 4`` is the paper's 4/2/2/2, 64 bytes a key at d = 128. Angle
codes are bit-packed at their width (the API reference's PolarQuantKVCache held one uint8 per angle).

Deviations from the paper:

1. A Haar orthogonal preconditioner, not a Gaussian one: same angle laws, keeps the norm, inverts by transpose.
2. Depth ``L = min(4, v)``, ``2**v`` the largest power of two dividing ``head_dim`` (the paper: 4); even
   ``head_dim`` only.
3. Offline codebooks only, from the analytic densities (Lloyd–Max on a 2^16-cell grid, cached); no online
   k-means++. Widths other than 4/2/2/2 follow the ``b, max(1, b-2)`` rule.
4. Values are int8 with an absmax scale (the project's API reference), so ``bit_width_inlier`` sets key
   precision only (value error ~0.2%, below the key error).
5. Attention rebuilds the rotated keys (float32 gathers + matmul); no fused kernel.

Shared behaviour: ``standalone_util.StandaloneCache``. A key norm beyond float16 raises ``CacheInputError``.
"""

from __future__ import annotations

from itertools import accumulate

import mlx.core as mx

from ...base import register
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.polar import angle_codebook, polar_levels, polar_transform, quantize_angles
from ...primitives.rotation import random_orthogonal
from ...primitives.rowstore import RowStore
from ...standalone_util import Int8Values, StandaloneCache, as_block, check_norm16, from_store

_MAX_LEVELS = 4


@register("polar")
class PolarQuantKVCache(Int8Values, StandaloneCache):
    """PolarQuant: rotated keys as per-level angle codes (known densities) and float16 radii; int8 values."""

    def __init__(self, config):
        initial = self._setup(config)
        d, b, seed = self.head_dim, self.bit_width_inlier, self.seed
        if d % 2:
            raise QuantizerConfigError("head_dim", d, "an even int >= 2 (the polar transform pairs coordinates)")
        self.levels = polar_levels(d, _MAX_LEVELS)
        self.level_bits = [b] + [max(1, b - 2)] * (self.levels - 1)
        self.level_sizes = [d >> level for level in range(1, self.levels + 1)]  # angles per level
        self.n_radii = d >> self.levels
        self.rotation = from_store(self.store, f"polar.rotation.d{d}.seed{seed}", lambda: random_orthogonal(d, seed),
                                   (d, d))
        self.codebooks = [angle_codebook(lv + 1, bits) for lv, bits in enumerate(self.level_bits)]
        self._cos = [mx.cos(c) for c in self.codebooks]
        self._sin = [mx.sin(c) for c in self.codebooks]
        self._high_bits = self.level_bits[1] if self.levels > 1 else None
        self._high_count = sum(self.level_sizes[1:])
        key_specs = {"a1": ((packed_words(self.level_sizes[0], b),), mx.uint32), "radii": ((self.n_radii,), mx.float16)}
        if self.levels > 1:
            key_specs["ah"] = ((packed_words(self._high_count, self._high_bits),), mx.uint32)
        self._keys = RowStore(key_specs, initial, self.capacity)
        self._values = self._value_store(d, initial)

    @property
    def key_bits_per_token(self) -> int:
        """Information bits of one key before word padding: angle codes + 16 per radius."""
        return sum(s * bits for s, bits in zip(self.level_sizes, self.level_bits)) + 16 * self.n_radii

    def _state_arrays(self) -> list:
        return [self.rotation, *self.codebooks, *self._cos, *self._sin]

    def append_key(self, k) -> None:
        k = as_block(k, self.head_dim, "key")[0]
        if k.shape[0] == 0:
            return
        check_norm16(k, "key")
        radii, angles = polar_transform(k @ self.rotation.T, self.levels)
        rows = {"a1": pack_bits(quantize_angles(angles[0], 1, self.level_bits[0]), self.level_bits[0]),
                "radii": radii.astype(mx.float16)}
        if self.levels > 1:
            high = [quantize_angles(psi, lv + 1, self._high_bits, self.codebooks[lv])
                    for lv, psi in enumerate(angles) if lv > 0]
            rows["ah"] = pack_bits(mx.concatenate(high, axis=1), self._high_bits)
        self._keys.append(rows)

    def angle_codes(self) -> list:
        """Per level, the ``(n_keys, d / 2**level)`` ``uint8`` angle codes (unpacked; for analysis)."""
        return self._codes(self._keys.n)

    def _codes(self, n: int) -> list:
        out = [unpack_bits(self._keys.view("a1")[:n], self.level_bits[0], self.level_sizes[0])]
        if self.levels > 1:
            high = unpack_bits(self._keys.view("ah")[:n], self._high_bits, self._high_count)
            out += mx.split(high, list(accumulate(self.level_sizes[1:-1])), axis=1)
        return out

    def _rotated_keys(self, n: int) -> mx.array:
        """``(n, d)`` float32 decoded keys in the rotated domain (``Pi k`` approximations)."""
        codes = self._codes(n)
        r = self._keys.view("radii")[:n].astype(mx.float32)
        for lv in reversed(range(self.levels)):
            idx = codes[lv].astype(mx.int32)
            c, s = mx.take(self._cos[lv], idx), mx.take(self._sin[lv], idx)
            r = mx.stack([r * c, r * s], axis=-1).reshape(n, 2 * r.shape[1])
        return r

    def reconstruct_keys(self) -> mx.array:
        """``(n_keys, d)`` float32 decoded keys in the original basis."""
        return self._rotated_keys(self._keys.n) @ self.rotation

    def _scores(self, q: mx.array, n: int) -> mx.array:
        return (q @ self.rotation.T) @ self._rotated_keys(n).T
