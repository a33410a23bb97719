"""SpectralQuant standalone single-head cache ("spectral"): calibrated principal subspaces + residual QJL.

Source: no arXiv paper; Dynamis Labs' SpectralQuant ("3% Is All You Need: Breaking TurboQuant's Compression
Limit via Spectral Structure", github.com/Dynamis-Labs/spectralquant, 2026): keys concentrate their variance in
a few principal directions (participation ratio ~3-4% of ``head_dim``), values less (~40-55).

Each side is calibrated once (mean ``mu``, covariance eigenbasis ``U``) from ``config.store`` or its first
``n_calib_tokens`` rows; with ``n_calib_tokens=None``, from every row held once ``head_dim`` have arrived (a first
block longer than ``head_dim`` calibrates on the whole block, rows fed one at a time on the first ``head_dim``).
Rows are held exactly until then. A row keeps its top ``r =
min(spectral_{key,val}_d_eff, head_dim)`` whitened coordinates ``U_r^T (x - mu) / sqrt(l_r)`` as a float16 norm
+ ``bit_width_inlier``-bit Lloyd–Max direction codes (signs for r = 1); ``spectral_apply_qjl`` adds 1-bit QJL
(arXiv 2406.03482) of the key residual. d = 128, 2 bits, m = 128: 24 + 18 bytes a token.

Deviations from SpectralQuant:

1. Directions beyond ``d_eff`` are dropped (0 bits), not coded coarser; ``d_eff`` is configured, not the
   measured participation ratio (:meth:`participation_ratio` reports that).
2. QJL sketches the whole key residual (dropped directions included), not the signal coordinates only.
3. All kept coordinates get the same bits (no water-filling), whitened (eigenvalues floored at 1e-4 of the
   largest) and coded as norm + direction; the norm is clamped to the float16 range.
4. Calibration is per cache (one head), from its first rows or the store entries
   ``<model>.spectral.<key|value>.d<d>.{mean,basis,eigenvalues}`` (``<model>`` escaped as ``_<hex>_`` outside
   ``[A-Za-z0-9.-]``): a per-layer/head basis needs a distinct ``spectral_model_name`` per cache.

Shared behaviour: ``standalone_util.StandaloneCache``. A centred norm or key residual norm beyond float16
raises ``CacheInputError``; ``reset()`` keeps the bases; ``state_bytes()`` counts the bases and sketch.
"""

from __future__ import annotations

import re
from typing import Optional

import mlx.core as mx
import numpy as np

from ...base import register
from ...errors import CacheInputError, QuantizerConfigError
from ...options import SpectralOptions
from ...primitives.bitpack import pack_bits, packed_words, unpack_bits
from ...primitives.codebook import lloyd_max_codebook, nearest_code
from ...primitives.lowrank_fit import fit_basis
from ...primitives.rowstore import RowStore
from ...primitives.sketch import gaussian_jl, qjl_dequantize, qjl_inner_product, qjl_pack
from ...standalone_util import (FP16_MAX, StandaloneCache, as_block, check_norm16, from_store, int_field, is_int,
                               jl_width, qjl_signs)

_TINY = 1e-30
_EIG_FLOOR = 1e-4  # whitening floor, relative to the largest eigenvalue
_PARTS = ("mean", "basis", "eigenvalues")  # a calibration's store entries


def _options(config) -> dict:
    """Option name -> value from ``config.options``, else from any config's flat fields (or defaults)."""
    o = getattr(config, "options", None)
    if isinstance(o, SpectralOptions):
        return {f: getattr(o, f) for f in SpectralOptions.FIELDS}
    return {f: getattr(config, flat, getattr(SpectralOptions, f)) for f, flat in SpectralOptions.FIELDS.items()}


def _eigen(rows: mx.array):
    """Mean, eigenvectors (columns, descending, largest entry positive) and eigenvalues of the rows'
    covariance (``lowrank_fit.fit_basis`` on one block), as float32 NumPy arrays."""
    vec, lam, mu = (np.array(a[0, 0], dtype=np.float64) for a in fit_basis(rows[None, None], center=True))
    sign = np.sign(vec[np.argmax(np.abs(vec), axis=0), np.arange(vec.shape[1])])
    vec = vec * np.where(sign == 0, 1.0, sign)[None, :]
    return mu[0].astype(np.float32), vec.astype(np.float32), (lam / rows.shape[0]).astype(np.float32)


class _Side:
    """One stream (keys or values): its basis once calibrated, its coded rows, or the exact rows held before."""

    def __init__(self, kind: str, d: int, r: int, bits: int, extra_specs: dict, initial: int, limit):
        self.kind, self.d, self.r, self.bits = kind, d, r, bits
        self.mean = self.basis = self.eigenvalues = self.sqrt_lam = None
        self.codebook = mx.array([-1.0, 1.0]) if r == 1 else lloyd_max_codebook(bits, r)
        specs = {"codes": ((packed_words(r, bits),), mx.uint32), "rho": ((), mx.float16), **extra_specs}
        self.rows = RowStore(specs, initial, limit)
        self.pending = mx.zeros((0, d))  # the exact (float32) rows held until calibration

    @property
    def calibrated(self) -> bool:
        return self.basis is not None

    @property
    def n(self) -> int:
        return self.rows.n if self.calibrated else self.pending.shape[0]

    def set_basis(self, mean, vectors, eigenvalues) -> None:
        self.mean = mx.array(mean, dtype=mx.float32)
        self.eigenvalues = mx.array(eigenvalues, dtype=mx.float32)
        self.basis = mx.array(vectors, dtype=mx.float32)[:, : self.r]
        lam = np.asarray(eigenvalues, dtype=np.float64)[: self.r]
        floor = max(float(lam.max(initial=0.0)) * _EIG_FLOOR, 1e-12)
        self.sqrt_lam = mx.array(np.sqrt(np.maximum(lam, floor)).astype(np.float32))

    def state_arrays(self) -> list:
        return [a for a in (self.mean, self.basis, self.eigenvalues, self.sqrt_lam, self.codebook) if a is not None]

    def nbytes(self) -> int:
        return self.rows.nbytes() + self.pending.nbytes

    def encode(self, x: mx.array):
        """``(n, d)`` rows -> (rows dict of codes and rho, decoded coefficients ``c_hat`` (n, r))."""
        z = ((x - self.mean) @ self.basis) / self.sqrt_lam
        zmax = mx.maximum(mx.max(mx.abs(z), axis=1, keepdims=True), _TINY)
        zs = z / zmax  # scaled first so that the norm cannot overflow
        zn = mx.sqrt(mx.sum(zs * zs, axis=1, keepdims=True))
        codes = nearest_code(zs / mx.maximum(zn, _TINY), self.codebook)
        rho16 = mx.minimum(zn[:, 0] * zmax[:, 0], FP16_MAX).astype(mx.float16)
        return {"codes": pack_bits(codes, self.bits), "rho": rho16}, self._coefficients(codes, rho16)

    def _coefficients(self, codes: mx.array, rho16: mx.array) -> mx.array:
        cent = mx.take(self.codebook, codes.astype(mx.int32))
        return cent * self.sqrt_lam[None, :] * rho16.astype(mx.float32)[:, None]

    def coefficients(self, n: int) -> mx.array:
        """Decoded coefficients ``c_hat`` ``(n, r)`` of the ``n`` oldest encoded rows."""
        codes = unpack_bits(self.rows.view("codes")[:n], self.bits, self.r)
        return self._coefficients(codes, self.rows.view("rho")[:n])

    def decode(self, n: int) -> mx.array:
        return self.mean + self.coefficients(n) @ self.basis.T

    def drop_oldest(self, n: int) -> None:
        if self.calibrated:
            self.rows.drop_oldest(n)
        else:
            self.pending = self.pending[n:]

    def clear(self) -> None:
        self.rows.clear()
        self.pending = self.pending[:0]


@register("spectral")
class SpectralQuantKVCache(StandaloneCache):
    """K/V on calibrated principal directions, whitened coefficients at ``bit_width_inlier`` bits, QJL residual."""

    def __init__(self, config):
        initial = self._setup(config)
        d, b, seed = self.head_dim, self.bit_width_inlier, self.seed
        o = _options(config)
        for f in ("key_d_eff", "val_d_eff"):
            if not is_int(o[f]) or o[f] < 1:
                raise QuantizerConfigError(f"spectral_{f}", o[f], "an int >= 1 (clipped to head_dim)")
        if not isinstance(o["apply_qjl"], bool):
            raise QuantizerConfigError("spectral_apply_qjl", o["apply_qjl"], "True or False")
        if not isinstance(o["model_name"], str) or not o["model_name"]:
            raise QuantizerConfigError("spectral_model_name", o["model_name"], "a non-empty str")
        self.apply_qjl, self.model_name = o["apply_qjl"], o["model_name"]
        m = jl_width(config, d)
        self.n_calib_tokens = int_field(config, "n_calib_tokens", 1, optional=True)
        self.jl_dim = m if self.apply_qjl else None
        self.key_d_eff, self.val_d_eff = min(int(o["key_d_eff"]), d), min(int(o["val_d_eff"]), d)
        qjl_specs = {"signs": ((packed_words(m, 1),), mx.uint32), "rnorm": ((), mx.float16)} if self.apply_qjl else {}
        self._keys = _Side("key", d, self.key_d_eff, b, qjl_specs, initial, self.capacity)
        self._values = _Side("value", d, self.val_d_eff, b, {}, initial, self.capacity)
        self.sketch = from_store(self.store, f"spectral.sketch.m{m}.d{d}.seed{seed}", lambda: gaussian_jl(m, d, seed),
                                 (m, d)) if self.apply_qjl else None
        for side in (self._keys, self._values):
            self._load(side)

    def _store_key(self, side: _Side, part: str) -> str:
        """The model name mapped injectively onto the ArtifactStore key alphabet, then side, dim and part."""
        name = re.sub(r"[^A-Za-z0-9.\-]", lambda m: f"_{ord(m.group()):x}_", self.model_name)
        return f"{name}.spectral.{side.kind}.d{self.head_dim}.{part}"

    def _load(self, side: _Side) -> None:
        keys, d = [self._store_key(side, p) for p in _PARTS], self.head_dim
        parts = [None] if self.store is None else [self.store.get(k) for k in keys]
        if any(p is None for p in parts):
            return
        for p, key, shape in zip(parts, keys, ((d,), (d, d), (d,))):
            if tuple(p.shape) != shape:
                raise QuantizerConfigError("store", key, f"an artifact of shape {shape}, got {tuple(p.shape)}")
        side.set_basis(*(np.asarray(p, dtype=np.float32) for p in parts))

    def _calibrate_side(self, side: _Side, rows: mx.array, held: mx.array) -> None:
        """Calibrate ``side`` on ``rows`` and encode the ``held`` rows; no change if anything raises."""
        if side.rows.n:
            raise CacheInputError(f"the {side.kind} side already holds encoded rows; build a new cache to recalibrate")
        mean, vectors, lam = _eigen(rows)
        old = (side.mean, side.basis, side.eigenvalues, side.sqrt_lam)
        side.set_basis(mean, vectors, lam)
        try:
            encoded = self._encode_rows(side, held) if held.shape[0] else None
        except CacheInputError:
            side.mean, side.basis, side.eigenvalues, side.sqrt_lam = old
            raise
        if self.store is not None:
            for part, arr in zip(_PARTS, (mean, vectors, lam)):
                self.store.put(self._store_key(side, part), mx.array(arr))
        side.pending = side.pending[:0]
        if encoded is not None:
            side.rows.append(encoded)

    def calibrate(self, keys=None, values=None) -> None:
        """Replace the key and/or value basis by one from sample rows ``(n, d)`` (not stored); rows held for
        calibration are then encoded. Raises ``CacheInputError`` if that side already holds encoded rows."""
        for side, x, what in ((self._keys, keys, "keys"), (self._values, values, "values")):
            if x is None:
                continue
            x = as_block(x, self.head_dim, what)[0]
            if x.shape[0] < 2:
                raise CacheInputError(f"calibration {what} need at least 2 rows, got {x.shape[0]}")
            self._calibrate_side(side, x, side.pending)

    def _append(self, side: _Side, x: mx.array) -> None:
        if not x.shape[0]:
            return
        if side.calibrated:
            side.rows.append(self._encode_rows(side, x))
            return
        check_norm16(x, side.kind)
        held = mx.concatenate([side.pending, x], axis=0)
        need = self.n_calib_tokens if self.n_calib_tokens is not None else self.head_dim
        if held.shape[0] >= max(need, 2):
            calib = held if self.n_calib_tokens is None else held[: self.n_calib_tokens]
            self._calibrate_side(side, calib, held)
        else:
            mx.eval(held)
            side.pending = held

    def _encode_rows(self, side: _Side, x: mx.array) -> dict:
        """Per-token arrays of the encoded rows ``x`` (raises ``CacheInputError`` before any change)."""
        if mx.max(mx.sum((x - side.mean) ** 2, axis=1)).item() > FP16_MAX**2:
            raise CacheInputError(f"{side.kind} is farther than {FP16_MAX} from the calibrated mean")
        rows, chat = side.encode(x)
        if side is self._keys and self.apply_qjl:
            resid = x - (side.mean + chat @ side.basis.T)
            rnorm = mx.sqrt(mx.sum(resid * resid, axis=1))
            if mx.max(rnorm).item() > FP16_MAX:
                raise CacheInputError(f"key residual norm exceeds the float16 range ({FP16_MAX})")
            rows["signs"] = qjl_pack(self.sketch, resid)
            rows["rnorm"] = rnorm.astype(mx.float16)
        return rows

    def _side(self, kind: str) -> _Side:
        if kind not in ("key", "value"):
            raise ValueError(f"kind={kind!r} is invalid: expected 'key' or 'value'")
        return self._keys if kind == "key" else self._values

    def calibrated(self, kind: str = "key") -> bool:
        return self._side(kind).calibrated

    def eigenvalues(self, kind: str = "key") -> Optional[mx.array]:
        """The full calibrated covariance spectrum ``(d,)``, descending (None before calibration)."""
        return self._side(kind).eigenvalues

    def basis(self, kind: str = "key") -> Optional[mx.array]:
        """The ``(d, r)`` principal directions kept (columns), or None before calibration."""
        return self._side(kind).basis

    def mean(self, kind: str = "key") -> Optional[mx.array]:
        return self._side(kind).mean

    def participation_ratio(self, kind: str = "key") -> Optional[float]:
        """``(sum l)^2 / sum l^2`` of the calibrated spectrum (SpectralQuant's ``d_eff``)."""
        lam = self._spectrum(kind)
        return None if lam is None else float(lam.sum() ** 2 / max((lam * lam).sum(), 1e-300))

    def captured_energy(self, kind: str = "key") -> Optional[float]:
        """Fraction of the calibration variance on the kept directions: ``sum_{j<r} l_j / sum_j l_j``."""
        lam = self._spectrum(kind)
        return None if lam is None else float(lam[: self._side(kind).r].sum() / max(lam.sum(), 1e-300))

    def _spectrum(self, kind: str) -> Optional[np.ndarray]:
        lam = self._side(kind).eigenvalues
        return None if lam is None else np.asarray(lam, dtype=np.float64)

    def _state_arrays(self) -> list:
        out = self._keys.state_arrays() + self._values.state_arrays()
        return out + ([self.sketch] if self.sketch is not None else [])

    def append_key(self, k) -> None:
        self._append(self._keys, as_block(k, self.head_dim, "key")[0])

    def append_value(self, v) -> None:
        self._append(self._values, as_block(v, self.head_dim, "value")[0])

    def _qjl_term(self, n: int, fn):
        return fn(qjl_signs(self._keys.rows, "signs", n, self.jl_dim), self._keys.rows.view("rnorm")[:n], self.sketch)

    def _scores(self, q: mx.array, n: int) -> mx.array:
        side = self._keys
        if not side.calibrated:
            return q @ side.pending[:n].T
        s = (q @ side.mean)[:, None] + (q @ side.basis) @ side.coefficients(n).T
        if self.apply_qjl:
            s = s + self._qjl_term(n, lambda *a: qjl_inner_product(q, *a))
        return s

    def reconstruct_keys(self, with_qjl: bool = True) -> mx.array:
        """``(n_keys, d)`` float32 decoded keys ``mu + U_r c_hat`` plus, with QJL (and ``with_qjl``), the
        score-correction term ``sqrt(pi/2)/m ||e|| S^T sign(S e)`` (not an MSE reconstruction). Rows held
        before calibration are returned exactly."""
        side, n = self._keys, self._keys.n
        if not side.calibrated:
            return side.pending[:n]
        out = side.decode(n)
        return out + self._qjl_term(n, qjl_dequantize) if self.apply_qjl and with_qjl else out

    def reconstruct_values(self) -> mx.array:
        """``(n_values, d)`` float32 decoded values (exact for rows held before calibration)."""
        side = self._values
        return side.decode(side.n) if side.calibrated else side.pending

    def _attend_values(self, w: mx.array, n: int) -> mx.array:
        side = self._values  # calibrated: mu_V + (w @ c_hat) U_V^T, no value decoded to d dimensions
        if side.calibrated:
            return side.mean[None, :] + (w @ side.coefficients(n)) @ side.basis.T
        return w @ side.pending[:n]
