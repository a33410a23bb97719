"""TurboQuant standalone single-head caches (Zandieh, Daliri, Hadian, Mirrokni; arXiv 2504.19874).

``turboquant_mse`` (Algorithm 1): a key's norm and its direction rotated by a seeded Haar-random ``Pi``, each
coordinate coded as its nearest ``b``-bit Lloyd–Max centroid for a random unit vector's coordinate law (``b =
bit_width_inlier``). ``turboquant_prod`` (Algorithm 2): a ``(b-1)``-bit MSE stage, then 1-bit QJL (arXiv
2406.03482) of the residual: unbiased scores; ``b = 1`` is pure QJL. With ``n_outlier_channels`` (the paper's
KV-cache split) the channels of largest RMS over the first ``n_calib_tokens`` keys get ``bit_width_outlier`` bits
and their own rotation, codebook and norm.

Deviations from the paper:

1. Norms are float16; the Prod residual is taken against the fp16-rounded MSE reconstruction (QJL term
   relative error at most 2^-11).
2. The Prod sketch acts on the rotated residual (``sign(S Pi r)``, query ``S Pi q``): ``S Pi`` is again i.i.d.
   Gaussian, so the estimator has the same distribution, and nothing is de-rotated.
3. The sketch size ``m = jl_dim`` is configurable (the paper: ``m = d``).
4. Outlier channels are chosen once, from the first key block, until ``reset()``; in Prod each group has its
   own ``(b_g - 1)``-bit MSE stage but one QJL sketch covers both groups' residual (still unbiased); a 1-bit
   Prod group is pure QJL on that group.
5. Values are int8 with an absmax scale (the project spec), not TurboQuant-coded: ~0.2% error.
6. Codebooks are numerical (Lloyd–Max on a 2^18-cell grid of the exact density, cached), the rotation a dense
   QR-based Haar matrix, attention a float32 gather + matmul (no fused kernel).

Shared behaviour: ``standalone_util.StandaloneCache``. A key norm beyond float16 raises ``CacheInputError``;
value entries beyond ``127 * 65504`` are clipped; ``bit_width_outlier`` (None: ``bit_width_inlier``, as the API
reference documents) is only range-checked without a split; ``observers`` and ``store`` are kept but unused.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ...base import register
from ...errors import QuantizerConfigError
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.codebook import lloyd_max_codebook, nearest_code
from ...primitives.rotation import random_orthogonal
from ...primitives.sketch import gaussian_jl, qjl_dequantize, qjl_inner_product, qjl_pack
from ...primitives.rowstore import RowStore
from ...standalone_util import (Int8Values, StandaloneCache, as_block, check_norm16, derive_seed, int_field,
                               jl_width, qjl_signs)

_TINY = 1e-30


class _Group:
    """One independently quantized channel group: rotation, codebook, bit width."""

    def __init__(self, index: int, dim: int, mse_bits: int, seed: int):
        self.index, self.dim, self.mse_bits = index, dim, mse_bits
        self.rotation = random_orthogonal(dim, seed)  # y = x @ rotation.T
        self.centroids = lloyd_max_codebook(mse_bits, dim) if mse_bits > 0 else None
        self.words = packed_words(dim, mse_bits) if mse_bits > 0 else 0

    def state_arrays(self) -> list:
        return [a for a in (self.rotation, self.centroids) if a is not None]


class TurboQuantKVCache(Int8Values, StandaloneCache):
    """The API reference's ``TurboQuantKVCache(config)``: built as ``TurboQuantProdKVCache``, or as
    ``TurboQuantMSEKVCache`` for ``config.method == "turboquant_mse"`` (both are instances of this class, which
    holds their shared machinery: outlier-split channel groups, key storage, scores)."""
    _prod = False

    def __new__(cls, config=None):  # None: copy.copy re-creating an instance
        if cls is TurboQuantKVCache:
            method = getattr(config, "method", "turboquant_prod")
            if method not in ("turboquant_prod", "turboquant_mse"):
                raise QuantizerConfigError("method", method, "'turboquant_prod' or 'turboquant_mse' for "
                                                             "TurboQuantKVCache (KVCacheFactory.create builds any)")
            cls = TurboQuantMSEKVCache if method == "turboquant_mse" else TurboQuantProdKVCache
        return super().__new__(cls)

    def __init__(self, config):
        initial = self._setup(config)
        d, b_in = self.head_dim, self.bit_width_inlier
        n_out = getattr(config, "n_outlier_channels", None)
        split = n_out is not None and n_out != 0
        if split and d < 4:
            raise QuantizerConfigError("n_outlier_channels", n_out, "None or 0 (an outlier split needs head_dim >= 4)")
        n_out = int_field(config, "n_outlier_channels", 2, d - 2) if split else 0
        b_out = int_field(config, "bit_width_outlier", 1, 8, optional=True)  # checked even when unused
        b_out = b_in if b_out is None else b_out  # the API reference: None -> same as inlier
        self.n_calib_tokens = int_field(config, "n_calib_tokens", 1, optional=True)
        self.jl_dim = jl_width(config, d) if self._prod else None
        self.bit_width_outlier, self.n_outlier_channels = b_out if split else None, n_out
        stage = 1 if self._prod else 0  # Prod spends one bit per coordinate-equivalent on QJL
        parts = [(n_out, b_out, derive_seed(self.seed, 1)), (d - n_out, b_in, derive_seed(self.seed, 2))] if split \
            else [(d, b_in, self.seed)]
        self.groups = [_Group(i, size, b - stage, sd) for i, (size, b, sd) in enumerate(parts)]
        self.sketch = gaussian_jl(self.jl_dim, d, self.seed) if self._prod else None
        self._perm = self._inv_perm = None  # channel permutation (outliers first); None: identity / not calibrated
        key_specs = {k: v for g in self.groups if g.mse_bits > 0
                     for k, v in ((f"codes{g.index}", ((g.words,), mx.uint32)), (f"norm{g.index}", ((), mx.float16)))}
        if self._prod:
            key_specs.update(qjl=((packed_words(self.jl_dim, 1),), mx.uint32), rnorm=((), mx.float16))
        self._keys = RowStore(key_specs, initial, self.capacity)
        self._values = self._value_store(d, initial)

    rotation = property(lambda self: self.groups[0].rotation)  # of the first (or only) channel group

    @property
    def outlier_channels(self) -> Optional[mx.array]:
        """Sorted outlier channel indices once calibrated (None without a split / before)."""
        return None if not self.n_outlier_channels or self._perm is None else self._perm[: self.n_outlier_channels]

    def _state_arrays(self) -> list:
        out = [a for g in self.groups for a in g.state_arrays()]
        return out + [a for a in (self.sketch, self._perm, self._inv_perm) if a is not None]

    def reset(self) -> None:
        """Drop all tokens and the outlier-channel choice; rotations, codebooks and the JL matrix are kept."""
        super().reset()
        self._perm = self._inv_perm = None

    def _calibrate(self, k: mx.array) -> None:
        rows = k if self.n_calib_tokens is None else k[: self.n_calib_tokens]
        order = np.argsort(-np.asarray(mx.sum(rows * rows, axis=0)), kind="stable")
        n = self.n_outlier_channels  # outliers first, each part in channel order
        perm = np.concatenate([np.sort(order[:n]), np.sort(order[n:])]).astype(np.int32)
        self._perm, self._inv_perm = mx.array(perm), mx.array(np.argsort(perm).astype(np.int32))

    def _split(self, x: mx.array, permute: bool = True) -> list:
        """``(n, d)`` (in original channel order when ``permute``) -> per-group ``(n, d_g)`` pieces."""
        if permute and self._perm is not None:
            x = mx.take(x, self._perm, axis=1)
        return mx.split(x, [self.groups[0].dim], axis=1) if len(self.groups) > 1 else [x]

    def append_key(self, k) -> None:
        k = as_block(k, self.head_dim, "key")[0]
        if k.shape[0] == 0:
            return
        check_norm16(k, "key")
        if self.n_outlier_channels and self._perm is None:
            self._calibrate(k)
        rows, residuals = {}, []
        for g, x in zip(self.groups, self._split(k)):
            if g.mse_bits == 0:  # pure-QJL group: the whole (rotated) sub-vector is the residual
                residuals.append(x @ g.rotation.T)
                continue
            norm = mx.sqrt(mx.sum(x * x, axis=1))
            y = (x / mx.maximum(norm, _TINY)[:, None]) @ g.rotation.T
            codes = nearest_code(y, g.centroids)
            norm16 = norm.astype(mx.float16)
            rows[f"codes{g.index}"] = pack_bits(codes, g.mse_bits)
            rows[f"norm{g.index}"] = norm16
            if self._prod:
                recon = mx.take(g.centroids, codes.astype(mx.int32)) * norm16.astype(mx.float32)[:, None]
                residuals.append(norm[:, None] * y - recon)
        if self._prod:
            r = mx.concatenate(residuals, axis=1) if len(residuals) > 1 else residuals[0]
            rows["qjl"] = qjl_pack(self.sketch, r)
            rows["rnorm"] = mx.sqrt(mx.sum(r * r, axis=1)).astype(mx.float16)
        self._keys.append(rows)

    def _rotated_keys(self, n: int) -> list:
        """Per group, the stored MSE reconstructions ``||k_g|| c[idx]`` in the rotated domain (None: pure QJL)."""
        def group(g):
            codes = unpack_bits(self._keys.view(f"codes{g.index}")[:n], g.mse_bits, g.dim).astype(mx.int32)
            return mx.take(g.centroids, codes) * self._keys.view(f"norm{g.index}")[:n].astype(mx.float32)[:, None]
        return [group(g) if g.mse_bits else None for g in self.groups]

    def _qjl_signs(self, n: int) -> mx.array:
        return qjl_signs(self._keys, "qjl", n, self.jl_dim)

    def _scores(self, q: mx.array, n: int) -> mx.array:
        total = mx.zeros((q.shape[0], n), dtype=mx.float32)
        qrot = [qg @ g.rotation.T for g, qg in zip(self.groups, self._split(q))]
        for qr, kr in zip(qrot, self._rotated_keys(n)):
            if kr is not None:
                total = total + qr @ kr.T
        if self._prod:
            qr = mx.concatenate(qrot, axis=1) if len(qrot) > 1 else qrot[0]
            total = total + qjl_inner_product(qr, self._qjl_signs(n), self._keys.view("rnorm")[:n], self.sketch)
        return total

    def reconstruct_keys(self) -> mx.array:
        """``(n_keys, d)`` float32 decoded keys in the original basis; for Prod with the QJL term
        ``sqrt(pi/2)/m ||r|| S^T sign(S r)`` (an unbiased score estimate, not an MSE reconstruction)."""
        n = self._keys.n
        parts = [mx.zeros((n, g.dim), dtype=mx.float32) if kr is None else kr
                 for g, kr in zip(self.groups, self._rotated_keys(n))]
        if self._prod:
            qjl = qjl_dequantize(self._qjl_signs(n), self._keys.view("rnorm")[:n], self.sketch)
            parts = [p + q for p, q in zip(parts, self._split(qjl, permute=False))]
        x = mx.concatenate([p @ g.rotation for p, g in zip(parts, self.groups)], axis=1)
        return x if self._inv_perm is None else mx.take(x, self._inv_perm, axis=1)


@register("turboquant_mse")
class TurboQuantMSEKVCache(TurboQuantKVCache):
    """TurboQuant-MSE (Algorithm 1): rotation + ``bit_width_inlier``-bit Lloyd–Max codes per coordinate."""


@register("turboquant_prod")
class TurboQuantProdKVCache(TurboQuantKVCache):
    """TurboQuant-Prod (Algorithm 2): (b-1)-bit TurboQuant-MSE + 1-bit QJL of the residual: unbiased scores."""
    _prod = True
