"""AnchorKV and NSNQuant: each method's defining property and its bytes-per-token budget. The shared
cache contract (dispatch attention, dense path, generation, save/load round trip, deepcopy, trim, merge
refusal, validation) and the per-method configs (``make``) are in test_quant_contract.py."""

from __future__ import annotations

import math

import pytest

import mlx.core as mx

from veloxquant_mlx.cache.primitives import groupquant as gq

from contract_table import make, rand


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


# ------------------------------------------------------------------------------------- anchorkv
def test_anchorkv_anchors_exact_and_residual_beats_direct():
    """Tokens clustered around a few centres: anchors are bit-exact float16 rows, and residual coding
    against them has far lower error than direct per-token quantization at the same bits."""
    B, H, D, G, T = 1, 2, 64, 16, 512
    c = make("anchorkv", window=G, anchor_frac=2 / G, residual_bits=2, rho=0.7)
    assert c.n_anchors == 2
    centres = rand(B, H, T // G, 1, D) * 3 + 2.0  # one cluster per group, far from 0
    k = (centres + 0.05 * rand(B, H, T // G, G, D)).reshape(B, H, T, D).astype(mx.float16)
    v = (centres * 0.5 + 0.05 * rand(B, H, T // G, G, D)).reshape(B, H, T, D).astype(mx.float16)
    c.update_and_fetch(k, v)
    assert c.n_quant == T
    dk, dv = c._dense()
    am = c.anchor_mask()
    assert int(am.sum()) == B * H * (T // G) * 2
    assert bool(mx.all(mx.where(am[..., None], dk == k, True)))  # anchors exact
    direct = gq.dequantize(*gq.quantize(k, 2, G), 2, G)
    err_a = float(((dk.astype(mx.float32) - k) ** 2).mean())
    err_d = float(((direct - k) ** 2).mean())
    assert err_a < 0.1 * err_d, (err_a, err_d)
    # with unclustered data the theta rule falls back to direct coding: never much worse than direct
    c2 = make("anchorkv", window=G, residual_bits=2)
    x = rand(B, H, T, D, dtype=mx.float16)
    c2.update_and_fetch(x, x)
    d2, _ = c2._dense()
    direct2 = gq.dequantize(*gq.quantize(x, 2, G), 2, G)
    assert float(((d2 - x) ** 2).mean()) <= 1.02 * float(((direct2 - x) ** 2).mean())


def test_anchorkv_bytes_per_token():
    B, H, D, T = 1, 2, 64, 2048
    c = make("anchorkv", window=32)
    c.update_and_fetch(rand(B, H, T, D), rand(B, H, T, D))
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    budget = c.bytes_per_token_budget(D, D)
    assert abs(budget - 2 * (16 + 8 + 1 / 8 + 129 / 32)) < 1e-9
    measured = (c.used_nbytes - c.res_k.nbytes - c.res_v.nbytes) / (B * H * T)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    assert c.nbytes >= c.used_nbytes and c.nbytes / (B * H * T) < 1.2 * budget + 2 * 2 * D * 32 / T


# ------------------------------------------------------------------------------------- nsnquant
def test_nsnquant_normalization_matches_codebook_and_beats_plain_vq():
    """After NSN + rotation the coordinates of shifted, scaled tokens are ~ N(0, 1) (i.e. variance 1/D
    before the sqrt(D) scaling), which is what the codebook was trained on; plain VQ of the normalized,
    rotated tokens without the shift has a larger error on data with a common offset."""
    from veloxquant_mlx.cache.methods.quantization import nsnquant as nsn
    from veloxquant_mlx.cache.primitives.rotation import randomized_hadamard

    B, H, T, D = 1, 2, 512, 64
    offset = rand(1, H, 1, D) * 2.0  # a large shared channel offset (as keys have)
    scale = mx.exp(rand(B, H, T, 1) * 0.5)
    x = ((offset + rand(B, H, T, D) * 0.5) * scale).astype(mx.float16)
    rot = randomized_hadamard(D, 1234)
    books = nsn.nsn_codebooks(D, 8, 256, 2, 1234)
    y, n1, n2, mu = nsn.nsn_forward(x, None, rot)
    var = (y * y).mean(axis=(0, 1, 2))  # per coordinate
    assert abs(float(var.mean()) - 1.0) < 0.05 and float(var.max()) < 1.5 and float(var.min()) > 0.6
    assert float(mx.abs(y.mean(axis=2)).max()) < 0.2  # centred
    xh = nsn.nsn_inverse(nsn.vq_decode(nsn.vq_encode(y, books), books, D), n1.astype(mx.float16).astype(mx.float32),
                         n2.astype(mx.float16).astype(mx.float32), mu, rot)
    err_nsn = float(((xh - x) ** 2).sum() / (x.astype(mx.float32) ** 2).sum())
    # plain VQ: normalize + rotate only (no shift, no second normalization)
    xf = x.astype(mx.float32)
    nn = mx.sqrt((xf * xf).sum(-1, keepdims=True))
    yp = math.sqrt(D) * ((xf / nn) @ rot.T)
    xp = (nsn.vq_decode(nsn.vq_encode(yp, books), books, D) / math.sqrt(D)) @ rot * nn
    err_plain = float(((xp - xf) ** 2).sum() / (xf ** 2).sum())
    assert err_nsn < 0.5 * err_plain, (err_nsn, err_plain)
    # the cache stores exactly this coding
    c = make("nsnquant", residual_length=64)
    c.update_and_fetch(x, x)
    dk, _ = c._dense()
    assert c.n_quant == T and float(((dk - x) ** 2).sum() / (xf ** 2).sum()) < 1.05 * err_nsn + 1e-4


def test_nsnquant_bytes_per_token():
    B, H, D, T = 1, 2, 64, 2048
    c = make("nsnquant", residual_length=64)
    c.update_and_fetch(rand(B, H, T, D), rand(B, H, T, D))
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    budget = c.bytes_per_token_budget(D, D)
    assert budget == 2 * (2 * D / 8 + 4)
    assert c.k_codes.dtype == mx.uint32 and c.k_codes.shape[-1] == 2 * 8 * 8 // 32  # 16 codes x 8 bits
    measured = (c.used_nbytes - c.res_k.nbytes - c.res_v.nbytes) / (B * H * T)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
