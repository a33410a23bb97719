"""PolarQuant standalone cache (Han, Kacham, Karbasi, Mirrokni, Zandieh; arXiv 2502.02617).

``PolarQuantKVCache`` ("polar") -- a single-head cache implementing
:class:`veloxquant_mlx.core.abstractions.KVCache` whose keys are stored as quantized polar angles.

Algorithm (per key ``k`` in R^d)
    1. Random preconditioning: ``y = Pi k`` with a seeded Haar-random orthogonal ``Pi``. The direction
       of ``y`` is uniform on the sphere whatever ``k`` is, so the angles below follow known laws.
    2. Recursive polar transform over ``L`` levels (:mod:`~veloxquant_mlx.cache.primitives.polar`):
       level 1 turns the ``d/2`` coordinate pairs into radii and angles in ``[0, 2*pi)``; every
       further level pairs the previous radii into a radius and an angle in ``[0, pi/2]``. What is
       left is ``d / 2**L`` block radii (the norms of consecutive blocks of ``2**L`` coordinates of
       ``y``) and ``d/2 + d/4 + ... + d/2**L`` angles.
    3. Each angle is replaced by the index of the nearest centroid of its level's codebook, the
       MSE-optimal quantizer of that level's exact density (level 1: uniform on the circle; level
       ``l >= 2``: Lloyd–Max for ``∝ sin(2 psi)^(2^(l-1)-1)`` on ``[0, pi/2]``). No per-block scale or
       zero point is stored: the densities are known in advance, which is the point of the paper.
    4. Storage: the angle codes bit-packed at their bit width (level 1 in one ``uint32`` stream,
       levels ``2..L`` in another) and the block radii in float16.

    ``attend(q)`` rotates ``q`` once (``Pi q``), rebuilds the rotated keys from the codes (centroid
    cos/sin tables and the stored radii, walking the levels back down) and scores ``<Pi q, y_hat>``
    (= ``<q, Pi^T y_hat>``), so keys are never de-rotated.

Bit allocation (``b = bit_width_inlier``, 1..8): level-1 angles get ``b`` bits, angles of levels
``2..L`` get ``max(1, b - 2)`` bits. At ``b = 4`` this is the paper's allocation (4, 2, 2, 2 bits with
``L = 4``). Rationale: level-1 angles range over ``2*pi``, higher levels over ``pi/2`` (and concentrate
around ``pi/4``), so two fewer bits keep the same angular cell width; and each level contributes about
``||k||^2 * E[(psi - Q(psi))^2]`` to the squared reconstruction error, so the per-level angle MSEs
(:func:`~veloxquant_mlx.cache.primitives.polar.angle_distortion`) add up to the expected relative
error: 0.0323 at ``b = 4`` (0.0129 + 0.0099 + 0.0062 + 0.0034), before float16 radius rounding.

Storage per token (``d = head_dim``, ``L = 4``): level-1 codes ``b*d/2`` bits and higher-level codes
``max(1, b-2) * (d/4 + d/8 + d/16)`` bits, each stream padded to whole 32-bit words, + ``d/16``
float16 radii. ``d = 128, b = 4``: 256 + 112 bits -> 8 + 4 words = 48 bytes of angles + 16 bytes of
radii = 64 bytes (3.875 bits/coordinate before padding, exactly the paper's figure; 4 bits with it),
against 120 + 16 bytes when every angle takes a byte. Values: ``d`` int8 codes + one float16 absmax
scale per token. Per-token storage is preallocated and grown by doubling
(:class:`~veloxquant_mlx.cache.primitives.rowstore.RowStore`).

``memory_bytes()`` counts the per-token arrays held (codes, radii, values, scales, including the
preallocated capacity); the token-independent state -- the rotation, the angle codebooks and their
cos/sin tables -- is reported by ``state_bytes()``, as for the TurboQuant caches.

Deviations from the paper (all of them, as implemented here):

1. Preconditioning is a Haar-random orthogonal ``d x d`` matrix, not a Gaussian random matrix. Angles
   depend only on the direction, and the direction of ``Pi k`` and of a Gaussian-preconditioned ``S k``
   are both uniform on the sphere, so the angle laws (and codebooks) are the same; the orthogonal
   matrix also preserves the norm and is inverted by its transpose.
2. Depth: ``L = min(4, v)`` where ``2**v`` is the largest power of two dividing ``head_dim`` (the paper
   uses ``L = 4``: one float16 radius per 16 coordinates). ``head_dim`` must be even.
3. Codebooks are the offline ones, computed from the analytic angle densities (Lloyd–Max on a 2^16-cell
   grid, NumPy, cached); the paper's online variant (k-means++ on the prompt's own angles) is not
   implemented. Other bit widths than the paper's (4, 2, 2, 2) follow the ``b, max(1, b-2)`` rule above.
4. Values are not polar-coded: they are stored per token as symmetric int8 with one float16 absmax
   scale (``scale = max|v| / 127``), as the project's API reference specifies for this cache; so
   ``bit_width_inlier`` sets key precision only, and value error (~0.2% relative) stays well below the
   key error.
5. Attention rebuilds the rotated keys (float32 gathers of centroid cos/sin and a dense matmul); there
   is no fused kernel.

Shared behaviour (inputs, ``attend``, capacity): :class:`~veloxquant_mlx.cache.standalone_util.StandaloneCache`.
A key whose norm exceeds the float16 range of the radii raises ``CacheInputError``. With an
``ArtifactStore`` in ``config.store`` the rotation is kept there under ``polar.rotation.d<d>.seed<seed>``.
"""

from __future__ import annotations

import mlx.core as mx

from ...base import register
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.polar import angle_codebook, polar_levels, polar_transform, quantize_angles
from ...primitives.rotation import random_orthogonal
from ...primitives.rowstore import RowStore
from ...standalone_util import Int8Values, StandaloneCache, as_block, check_norm16, from_store

__all__ = ["PolarQuantKVCache"]

_MAX_LEVELS = 4


@register("polar")
class PolarQuantKVCache(Int8Values, StandaloneCache):
    """PolarQuant (arXiv 2502.02617): random rotation + recursive polar transform of each key, angles
    quantized per level with codebooks for their known densities and bit-packed, float16 block radii;
    int8 values. ``bit_width_inlier`` = b: level-1 angle bits (higher levels ``max(1, b-2)``; b = 4 is
    the paper's 4/2/2/2 allocation). See the module docstring for storage and every deviation.
    """

    def __init__(self, config):
        initial = self._setup(config)
        d, b, seed = self.head_dim, self.bit_width_inlier, self.seed
        if d % 2:
            raise QuantizerConfigError("head_dim", d, "an even int >= 2 (the polar transform pairs coordinates)")
        self.levels = polar_levels(d, _MAX_LEVELS)
        self.level_bits = [b] + [max(1, b - 2)] * (self.levels - 1)
        self.level_sizes = [d >> level for level in range(1, self.levels + 1)]  # angles per level
        self.n_radii = d >> self.levels
        self.rotation = from_store(
            self.store, f"polar.rotation.d{d}.seed{seed}", lambda: random_orthogonal(d, seed), (d, d)
        )
        self.codebooks = [angle_codebook(lv + 1, bits) for lv, bits in enumerate(self.level_bits)]
        self._cos = [mx.cos(c) for c in self.codebooks]
        self._sin = [mx.sin(c) for c in self.codebooks]
        self._high_bits = self.level_bits[1] if self.levels > 1 else None
        self._high_count = sum(self.level_sizes[1:])

        key_specs = {
            "a1": ((packed_words(self.level_sizes[0], b),), mx.uint32),
            "radii": ((self.n_radii,), mx.float16),
        }
        if self.levels > 1:
            key_specs["ah"] = ((packed_words(self._high_count, self._high_bits),), mx.uint32)
        self._keys = RowStore(key_specs, initial)
        self._values = self._value_store(d, initial)

    @property
    def key_bits_per_token(self) -> int:
        """Information bits of one key before word padding: angle codes + 16 per radius."""
        return sum(s * bits for s, bits in zip(self.level_sizes, self.level_bits)) + 16 * self.n_radii

    def _state_arrays(self) -> list:
        return [self.rotation, *self.codebooks, *self._cos, *self._sin]

    # ---- keys ------------------------------------------------------------------------------------

    def append_key(self, k) -> None:
        k, _ = as_block(k, self.head_dim, "key")
        if k.shape[0] == 0:
            return
        check_norm16(k, "key")
        radii, angles = polar_transform(k @ self.rotation.T, self.levels)
        rows = {
            "a1": pack_bits(quantize_angles(angles[0], 1, self.level_bits[0]), self.level_bits[0]),
            "radii": radii.astype(mx.float16),
        }
        if self.levels > 1:
            high = [
                quantize_angles(psi, lv + 1, self._high_bits, self.codebooks[lv])
                for lv, psi in enumerate(angles) if lv > 0
            ]
            rows["ah"] = pack_bits(mx.concatenate(high, axis=1), self._high_bits)
        self._keys.append(rows)

    def angle_codes(self) -> list:
        """Per level, the ``(n_keys, d / 2**level)`` ``uint8`` angle codes (unpacked; for analysis)."""
        return self._codes(self._keys.n)

    def _codes(self, n: int) -> list:
        out = [unpack_bits(self._keys.view("a1")[:n], self.level_bits[0], self.level_sizes[0])]
        if self.levels > 1:
            high = unpack_bits(self._keys.view("ah")[:n], self._high_bits, self._high_count)
            start = 0
            for size in self.level_sizes[1:]:
                out.append(high[:, start : start + size])
                start += size
        return out

    def _rotated_keys(self, n: int) -> mx.array:
        """``(n, d)`` float32 decoded keys in the rotated domain (``Pi k`` approximations)."""
        codes = self._codes(n)
        r = self._keys.view("radii")[:n].astype(mx.float32)
        for lv in reversed(range(self.levels)):
            idx = codes[lv].astype(mx.int32)
            c, s = mx.take(self._cos[lv], idx), mx.take(self._sin[lv], idx)
            r = mx.stack([r * c, r * s], axis=-1).reshape(n, -1)
        return r

    def reconstruct_keys(self) -> mx.array:
        """``(n_keys, d)`` float32 decoded keys in the original basis (for tests and analysis)."""
        return self._rotated_keys(self._keys.n) @ self.rotation

    def _scores(self, q: mx.array, n: int) -> mx.array:
        return (q @ self.rotation.T) @ self._rotated_keys(n).T
