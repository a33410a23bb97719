"""KVQuant (arXiv 2401.18079), GEAR (arXiv 2403.05527) and AdaKV: KIVI-layout subclasses with non-uniform
levels / dense-and-sparse outliers / low-rank error feedback / per-token bit tiers. Each paper's defining
property and byte accounting; the shared contract (dispatch == dense attention, dense path, bytes budget,
generate, state, deepcopy, trim, merge, validation) and the per-method configs (``make``) are in
test_quant_contract.py."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from veloxquant_mlx.cache.primitives import groupquant as gq
from veloxquant_mlx.cache.primitives import nonuniform as nu

from contract_table import make, rand


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(11)


# ------------------------------------------------------------------------------------- properties
def test_kvquant_trim_into_fitted_groups_refused():
    k, v = rand(1, 2, 104, 64), rand(1, 2, 104, 64)
    c = make("kvquant")
    c.update_and_fetch(k, v)
    with pytest.raises(ValueError, match="fitted"):  # the levels were fitted on all 3 prefill groups
        c.trim(8 + 32)
    assert c.trim(104) == 104 and c.empty()  # a refused trim left a cache that still works
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    ref = make("kvquant")
    ref.update_and_fetch(k[:, :, :40], v[:, :, :40])
    assert (c.offset, c.n_quant, c.n_res) == (ref.offset, ref.n_quant, ref.n_res)
    for x, y in zip(c._dense(), ref._dense()):
        assert bool(mx.array_equal(x, y))


def test_kvquant_nonuniform_beats_uniform_on_skewed_data_and_outliers_exact():
    # skewed channels (log-normal magnitudes): Lloyd levels beat evenly spaced ones at the same bits
    x = mx.exp(1.2 * rand(1, 2, 64, 512))  # [B, H, D, T]: per channel, 512 tokens
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    u = (x - lo) / (hi - lo)
    for bits in (2, 3):
        lv = nu.fit_levels(u, bits, 8)
        err_nu = float(mx.mean((nu.decode_levels(nu.encode_levels(u, lv), lv) - u) ** 2))
        uni = mx.broadcast_to(mx.arange(2**bits, dtype=mx.float32) / (2**bits - 1), lv.shape)
        err_uni = float(mx.mean((nu.decode_levels(nu.encode_levels(u, uni), uni) - u) ** 2))
        assert err_nu < 0.8 * err_uni, (bits, err_nu, err_uni)
    # in the cache: skewed keys quantize better than KIVI's uniform codes at the same bits and group
    k = mx.exp(1.2 * rand(1, 2, 256, 64)) * (1 + 4 * (mx.arange(64) % 7 == 0))
    k = k.at[0, 0, 100, 5].add(500.0)  # one huge outlier
    c = make("kvquant", bits=3)
    c.update_and_fetch(k, rand(1, 2, 256, 64))
    dk, _ = c._dense()
    uni = gq.dequantize_per_channel(*gq.quantize_per_channel(k, 3, 32), 3, 32)
    assert float(mx.mean((dk - k) ** 2)) < 0.5 * float(mx.mean((uni - k) ** 2))
    k16 = k.astype(mx.float16).astype(mx.float32)
    assert float(dk[0, 0, 100, 5]) == float(k16[0, 0, 100, 5])  # outlier kept exactly
    assert bool(mx.array_equal(dk[:, :, :1], k16[:, :, :1]))  # the sink token is exact
    # the sparse store holds the largest-magnitude entries of each block exactly
    idx = c.k_oidx[0, 0, :21].astype(mx.int32)
    vals = c.k_oval[0, 0, :21]
    blk = k16[0, 0, :32].T.reshape(-1)  # block 0 in [D, G] order
    assert bool(mx.array_equal(blk[idx], vals.astype(mx.float32)))
    assert float(mx.abs(vals).min()) >= float(mx.sort(mx.abs(blk))[-21])


def _lloyd_float64(u, bits, iters):
    """1-D Lloyd from the row quantiles, entry by entry, in float64 (the reference of ``fit_levels``)."""
    u = np.asarray(u, dtype=np.float64)
    L, T = 1 << bits, u.shape[-1]
    lv = np.sort(u, axis=-1)[..., np.minimum(((np.arange(L) + 0.5) / L * T).astype(np.int64), T - 1)]
    for _ in range(iters):
        code = (u[..., None] > 0.5 * (lv[..., 1:] + lv[..., :-1])[..., None, :]).sum(-1)
        onehot = code[..., None] == np.arange(L)
        cnt = onehot.sum(-2)
        lv = np.sort(np.where(cnt > 0, (onehot * u[..., None]).sum(-2) / np.maximum(cnt, 1), lv), axis=-1)
    return lv


def test_fit_levels_is_lloyd_on_sorted_runs():
    """``fit_levels`` (cells as runs of the sorted row: counts from the boundaries, sums from prefix sums) equals
    entry-by-entry Lloyd in float64, on rows whose cells are clear (clusters far apart, so round-off moves no entry
    across a boundary), with an empty cell (a level keeps its place) and rows of 7 to 2047 entries."""
    rng = np.random.default_rng(3)
    for T, bits in ((2047, 3), (300, 2), (7, 2)):
        centres = rng.uniform(0, 1, size=(2, 5, 1, 1 << bits))
        pick = rng.integers(0, 1 << bits, size=(2, 5, T))
        u = np.clip(np.take_along_axis(centres[..., 0, :], pick, -1) + rng.normal(0, 1e-3, (2, 5, T)), 0, 1)
        got = np.asarray(nu.fit_levels(mx.array(u.astype(np.float32)), bits, 8))
        want = _lloyd_float64(u.astype(np.float32), bits, 8)
        assert np.abs(got - want).max() <= 1e-5, (T, bits, np.abs(got - want).max())
    lv = nu.fit_levels(mx.array([[0.0, 0.0, 0.0, 1.0]]), 2, 4)  # fewer distinct values than levels
    assert np.allclose(np.asarray(lv)[0, [0, -1]], [0.0, 1.0])


def test_power_lowrank_fits_rank_r_exactly_and_nears_the_svd_otherwise():
    """GEAR's solver (``lowrank_fit.power_lowrank``): a rank-r matrix is fitted exactly; on a rank-2 signal in noise
    it captures >= 0.99 of the energy the exact SVD's rank-4 fit captures (subspace iteration converges there); its
    ``a`` has orthonormal columns; a zero matrix gives a zero fit (no NaN); a rank-2 matrix fitted at rank 16 is
    fitted exactly, the 14 columns outside its span 0."""
    from veloxquant_mlx.cache.primitives import lowrank_fit as lr

    rng = np.random.default_rng(5)
    low = rng.normal(size=(3, 6, 32, 4)) @ rng.normal(size=(3, 6, 4, 64))
    a, bt = lr.power_lowrank(mx.array(low.astype(np.float32)), 4)
    assert np.abs(np.asarray(a @ bt) - low).max() <= 1e-4 * np.abs(low).max()
    eye = np.asarray(a.swapaxes(-1, -2) @ a)
    assert np.abs(eye - np.eye(4)).max() <= 1e-5
    x = rng.normal(size=(4, 8, 32, 64)) + 0.5 * rng.normal(size=(4, 8, 32, 2)) @ rng.normal(size=(4, 8, 2, 64))
    a, bt = lr.power_lowrank(mx.array(x.astype(np.float32)), 4)
    s = np.linalg.svd(x, compute_uv=False)
    captured = (x**2).sum() - ((x - np.asarray(a @ bt).astype(np.float64)) ** 2).sum()
    assert captured >= 0.99 * (s[..., :4] ** 2).sum(), captured / (s[..., :4] ** 2).sum()
    a, bt = lr.power_lowrank(mx.zeros((2, 8, 16)), 3)
    assert float(mx.abs(a @ bt).max()) == 0.0
    # rank 2 fitted at rank 16: the columns past the span are 0 (normalized round-off was 8.7x the matrix off)
    low = rng.normal(size=(2, 64, 2)) @ rng.normal(size=(2, 2, 96))
    a, bt = lr.power_lowrank(mx.array(low.astype(np.float32)), 16)
    assert np.abs(np.asarray(a @ bt) - low).max() <= 1e-5 * np.abs(low).max()
    assert float(mx.abs(a[..., 2:]).max()) == 0.0


def test_gear_recovery_positive_and_growing_with_rank():
    k = rand(1, 2, 256, 64) + 6.0 * (mx.arange(64) == 9)
    v = rand(1, 2, 256, 64)
    rec, kbytes, errs = [], [], []
    for r in (1, 2, 4, 8, 16):
        c = make("gear", rank=r)
        c.update_and_fetch(k, v)
        dk, dv = c._dense()
        rec.append(c.error_recovery_ratio)
        kbytes.append(c.compressed_key_bytes)
        errs.append(float(mx.mean((dk - k) ** 2)))
        assert c.base_only_key_bytes < c.compressed_key_bytes
        # used bytes are its parts: base codes + sparse + low-rank factors, residual, 8 B per group
        assert c.compressed_key_bytes + c.compressed_value_bytes + c.res_k.nbytes * 2 + 256 // 32 * 8 == c.used_nbytes
        assert c.fp16_key_bytes == 2 * 256 * 64 * 2
    assert rec[0] > 0 and all(a < b for a, b in zip(rec, rec[1:])), rec
    assert all(a > b for a, b in zip(errs, errs[1:])) and all(a < b for a, b in zip(kbytes, kbytes[1:]))
    # the ratio is the measured one: recompute it from the arrays
    base = gq.dequantize_per_channel(*gq.quantize_per_channel(k, 2, 32), 2, 32)
    ratio = 1 - float(mx.sum((dk - k) ** 2)) / float(mx.sum((base - k) ** 2))
    assert abs(ratio - rec[-1]) < 1e-3


def test_gear_prompt_in_one_chunk_keeps_no_layer_s_rows_alive_past_the_layer():
    """A one-chunk prefill waits for each layer's codes, outliers and SVD factors before the layer's attention
    is queued: left to the chunk's end, every layer's float32 rows and SVD temporaries were alive together (ten more
    layers: 2.6 MB more peak than bytes held, here 0.12 MB; SmolLM2 at 1023 tokens: 1.44x -> 0.36x the plain
    cache's peak)."""
    from test_lowrank import one_chunk_depth_excess

    excess, rows = one_chunk_depth_excess("gear")
    assert excess <= rows / 4, f"gear: {excess} B more peak than bytes held over {rows} B of rows"


def test_gear_decode_row_completing_no_group_skips_store():
    """The prefill wait added to ``_store`` keeps KIVI's short decode path: a repeated one-row call that completes
    no group never reaches ``_store``."""
    c = make("gear")
    c.update_and_fetch(rand(1, 2, 40, 64), rand(1, 2, 40, 64))
    c.update_and_fetch(rand(1, 2, 1, 64), rand(1, 2, 1, 64))
    c._store = None  # a call reaching it fails
    c.update_and_fetch(rand(1, 2, 1, 64), rand(1, 2, 1, 64))
    assert (c.offset, c.n_quant, c.n_res) == (42, 32, 10)


@pytest.mark.parametrize("target", [2.0, 2.3, 2.5, 3.0, 3.7, 4.0])
def test_adakv_realized_average_and_important_tokens_get_more_bits(target):
    D, T = 64, 256
    k = rand(1, 2, T, D) * (1 + 3 * (mx.random.uniform(shape=(1, 2, T, 1)) > 0.8))  # 20% high-variance tokens
    v = rand(1, 2, T, D)
    c = make("adakv", target_avg_bits=target)
    c.update_and_fetch(k, v)
    # realized: count the code bits actually stored per token, from the arrays held
    rows = {t: (c.n_quant // c.group) * c.counts[t] for t in ("hi", "mid", "lo")}
    for t in rows:  # each tier's arrays hold exactly its rows (plus buffer slack), at its own width
        arr = getattr(c, f"k_codes_{t}")
        assert (arr is None) == (rows[t] == 0)
        if arr is not None:
            assert arr.shape[2] >= rows[t] and arr.shape[3] == c.tier_bits[t] * 2  # 32 codes / 32-bit word
    assert sum(rows.values()) == c.n_quant
    realized = sum(rows[t] * c.tier_bits[t] for t in rows) / c.n_quant
    assert abs(realized - target) <= 0.1 and abs(c.realized_avg_bits - target) <= 0.1, realized
    # the stored tier of each token: important (high-variance) tokens sit in the higher tiers
    order = c.order[:, :, :T].astype(mx.int32).reshape(1, 2, T // 32, 32)
    imp = mx.var(k, axis=-1) * (1 + mx.var(v, axis=-1))
    rank_imp = mx.take_along_axis(imp.reshape(1, 2, T // 32, 32), order, axis=-1)
    assert bool(mx.all(rank_imp[..., :-1] >= rank_imp[..., 1:]))  # tiers filled in importance order
    dk, _ = c._dense()
    err = mx.mean((dk - k) ** 2, axis=-1) / mx.var(k, axis=-1)  # relative error per token
    big = mx.var(k, axis=-1) > 3
    if 0 < c.counts["hi"] + c.counts["mid"] < 32 and c.counts["lo"]:
        assert float(mx.mean(mx.where(big, err, 0)).item()) / float(mx.mean(big)) < \
            float(mx.mean(mx.where(big, 0, err))) / float(mx.mean(~big))


def test_gear_rank_from_the_threshold_comes_from_its_fit_without_an_svd(monkeypatch):
    """Without ``gear_rank`` the first block's rank is read off the subspace iteration's own fit (``fit_energies``),
    not an SVD (MLX's is CPU-only: 0.78 of 1.19 s of a GPU prefill): a low threshold takes rank 1, one no fit under
    the cap meets takes the cap (min(G, D) // 8 = 4), and the factors kept are that wide. On its own the fit's rank
    is never below the exact SVD's for the same matrix (its first r columns hold at most the top r's energy)."""
    from veloxquant_mlx.cache.primitives import lowrank_fit as lr

    def no_svd(*a, **k):
        raise AssertionError("an SVD was taken")

    monkeypatch.setattr(mx.linalg, "svd", no_svd)
    rng = np.random.default_rng(3)
    shape = (1, 2, 64, 64)
    for thr, want in ((0.01, 1), (0.999, 4)):
        c = make("gear", energy_threshold=thr)
        c.update_and_fetch(*(mx.array(rng.normal(size=shape).astype(np.float32)) for _ in range(2)))
        assert c.rank == want
        assert c.k_a.shape[-1] == want and c.k_bt.shape[-1] >= 2 * want * 64  # two groups' factors
    x = mx.array(rng.normal(size=(2, 3, 32, 64)).astype(np.float32))
    x = x + 4.0 * mx.array(rng.normal(size=(2, 3, 32, 1)) @ rng.normal(size=(2, 3, 1, 64)), dtype=mx.float32)
    s = np.linalg.svd(np.asarray(x, dtype=np.float64), compute_uv=False)
    _, bt = lr.power_lowrank(x, 8)
    fitted = lr.fit_energies(x, bt)
    assert fitted.shape == (2, 3, 9)
    assert np.allclose(np.asarray(fitted.sum(-1)), (np.asarray(x, dtype=np.float64) ** 2).sum((-2, -1)), rtol=1e-4)
    for thr in (0.1, 0.3, 0.5, 0.7, 0.9):
        exact = lr.energy_rank(mx.array((s * s).astype(np.float32)), thr)
        assert lr.energy_rank(fitted, thr) >= min(exact, 9), thr


def test_power_lowrank_routes_to_its_kernel_checked_against_the_op_path(monkeypatch):
    """Where the fit kernel applies (CUDA), ``power_lowrank`` hands it the start ``omega`` and the iteration count
    and checks it once against the op path (``kernels.checked_call``); a kernel that differs is turned off and the
    op path's fit returned. The plumbing, with stand-in kernels (the real one is tested on CUDA below)."""
    from veloxquant_mlx.cache.kernels import _common, power_fit
    from veloxquant_mlx.cache.primitives import lowrank_fit as lr

    x = mx.random.normal((2, 3, 32, 48), key=mx.random.key(4))
    want = lr._power_ops(x, mx.random.normal((48, 4), key=mx.random.key(0)), lr.POWER_ITERS)
    seen = []

    def stand_in(xx, omega, iters):
        seen.append((omega.shape, iters))
        return lr._power_ops(xx, omega, iters)

    monkeypatch.setattr(lr, "_fit_kernel_applies", lambda x, rank: True)
    monkeypatch.setattr(power_fit, "fit", stand_in)
    monkeypatch.setattr(_common, "_checked", set())
    monkeypatch.setattr(_common, "_disabled", set())
    a, bt = lr.power_lowrank(x, 4)
    assert seen == [((48, 4), lr.POWER_ITERS)] and "power_fit" in _common._checked
    assert np.array_equal(np.asarray(a @ bt), np.asarray(want[0] @ want[1]))
    monkeypatch.setattr(_common, "_checked", set())
    monkeypatch.setattr(power_fit, "fit", lambda xx, omega, iters: (want[0], 2.0 * want[1]))
    with pytest.warns(RuntimeWarning, match="power_fit"):
        a, bt = lr.power_lowrank(x, 4)
    assert "power_fit" in _common._disabled and np.array_equal(np.asarray(bt), np.asarray(want[1]))


@pytest.mark.skipif(not __import__("veloxquant_mlx.cache.kernels", fromlist=["x"]).kernels_enabled(),
                    reason="the fit kernel needs MLX's CUDA backend (none here)")
@pytest.mark.parametrize("lead,m,n,r", [((1, 8, 64), 32, 128, 4), ((3, 5), 16, 64, 3), ((7,), 20, 50, 5),
                                        ((2,), 64, 96, 16)])
def test_power_fit_kernel_equals_the_op_path(lead, m, n, r):
    """``kernels.power_fit`` (what ``power_lowrank`` runs on CUDA): the fit ``a @ bt`` equals the op path's to float32
    rounding (relative to the matrices' own size), ``a`` has orthonormal columns, an exact rank-2 matrix is fitted
    exactly at rank r >= 2 (its columns past the span 0, as the op path's), and a zero matrix gives a zero fit (no
    NaN)."""
    from veloxquant_mlx.cache.kernels import _common, power_fit
    from veloxquant_mlx.cache.primitives import lowrank_fit as lr

    rng = np.random.default_rng(m * n + r)
    x = rng.normal(size=(*lead, m, n)) + 3.0 * rng.normal(size=(*lead, m, 1)) @ rng.normal(size=(*lead, 1, n))
    x = mx.array(x.astype(np.float32))
    omega = mx.random.normal((n, r), key=mx.random.key(0))
    a, bt = power_fit.fit(x, omega, lr.POWER_ITERS)
    wa, wbt = lr._power_ops(x, omega, lr.POWER_ITERS)
    got, want = np.asarray(a @ bt, dtype=np.float64), np.asarray(wa @ wbt, dtype=np.float64)
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)
    eye = np.asarray(a.swapaxes(-1, -2) @ a)
    assert np.abs(eye - np.eye(r)).max() <= 1e-4
    low = rng.normal(size=(*lead, m, 2)) @ rng.normal(size=(*lead, 2, n))
    a, bt = power_fit.fit(mx.array(low.astype(np.float32)), omega, lr.POWER_ITERS)
    assert np.abs(np.asarray(a @ bt) - low).max() <= 1e-5 * np.abs(low).max()
    if r > 2:
        assert float(mx.abs(a[..., 2:]).max()) == 0.0  # outside the span: 0
    a, bt = power_fit.fit(mx.zeros((*lead, m, n)), omega, lr.POWER_ITERS)
    assert float(mx.abs(a @ bt).max()) == 0.0 and not np.isnan(np.asarray(a)).any()
    a, bt = lr.power_lowrank(x, r)  # takes the kernel on this backend, checked once
    assert "power_fit" in _common._checked and "power_fit" not in _common._disabled


def test_gear_trim_into_the_block_its_rank_was_read_from_raises():
    """The threshold's rank is read from the whole first block: a trim keeping part of it would leave groups whose
    factors have a rank a cache fed only those tokens might not take, so it raises (the server then recomputes); a
    trim of all of it starts afresh; with a given ``gear_rank`` there is nothing to go stale."""
    k, v = rand(1, 2, 64, 64), rand(1, 2, 64, 64)
    c = make("gear")
    c.update_and_fetch(k, v)
    assert c.calib_end == 64 and c.rank > 0
    with pytest.raises(ValueError, match="first 64 coded tokens"):
        c.trim(32)
    assert c.trim(64) == 64 and (c.calib_end, c.rank) == (0, -1)
    g = make("gear", rank=2)
    g.update_and_fetch(k, v)
    assert g.calib_end == 0 and g.trim(32) == 32 and g.rank == 2
