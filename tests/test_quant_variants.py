"""Group-quantizer variants built on KIVI's layout: kivi_sink, kitty, skvq, age_tiered, zipcache.

Each method's defining property and its bytes-per-token budget. The shared cache contract (dispatch
attention, dense path, generation, state round trip, deepcopy, trim, merge refusal, validation) and the
per-method configs (``make``) are in test_quant_contract.py."""

from __future__ import annotations

import copy

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import KVCacheConfig, KVCacheFactory, dispatch
from veloxquant_mlx.cache.primitives import groupquant as gq

from contract_table import make, rand


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


# ------------------------------------------------------------------------------------- kivi_sink
def test_kivi_sink_rows_bit_exact_rest_is_kivi():
    from veloxquant_mlx.cache.methods.quantization.kivi import KIVIKVCache

    S, D = 5, 64
    c = make("kivi_sink", bits=2, n_sink_tokens=S)
    plain = KVCacheFactory.create(KVCacheConfig(method="kivi", bit_width_inlier=2, head_dim=D))
    assert isinstance(c, KIVIKVCache)
    k = rand(1, 2, 100, D, dtype=mx.float16) * 4
    v = rand(1, 2, 100, D, dtype=mx.float16)
    for lo, hi in [(0, 3), (3, 4), (4, 70), (70, 71), (71, 100)]:
        c.update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
    plain.update_and_fetch(k[:, :, S:], v[:, :, S:])  # KIVI over the tokens after the sinks
    dk, dv = c._dense()
    assert bool(mx.array_equal(dk[:, :, :S], k[:, :, :S])) and bool(mx.array_equal(dv[:, :, :S], v[:, :, :S]))
    pk, pv = plain._dense()
    assert bool(mx.array_equal(dk[:, :, S:], pk)) and bool(mx.array_equal(dv[:, :, S:], pv))
    assert (c.n_sink, c.n_quant, c.n_res) == (S, 64, 31)
    # trimming into the sinks is exact once every group is gone
    assert c.trim(100 - 3) == 97 and (c.n_sink, c.n_quant, c.n_res) == (3, 0, 0)


def test_kivi_sink_bytes_per_token():
    B, H, D, T, G, S = 1, 2, 64, 2048, 32, 5
    c = make("kivi_sink", bits=2, n_sink_tokens=S)
    c.update_and_fetch(rand(B, H, T + S, D), rand(B, H, T + S, D))
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    budget = 2 * (2 * D / 8 + 4 * D / G)
    measured = (c.used_nbytes - c.sink_k.nbytes - c.sink_v.nbytes) / (B * H * T)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    assert c.sink_k.nbytes + c.sink_v.nbytes == 2 * B * H * S * D * 2


# ------------------------------------------------------------------------------------- kitty
def test_kitty_hi_channels_lower_error_and_mixed_budget():
    B, H, D, T, G = 1, 2, 64, 4096, 32
    c = make("kitty", hi_fraction=0.25, hi_bit=4, lo_bit=2, group_size=G)
    scale = 1 + 6 * (mx.random.uniform(shape=(1, H, 1, D)) > 0.8)  # a few large channels
    k = rand(B, H, T, D) * scale
    c.update_and_fetch(k, rand(B, H, T, D))
    bits = c.key_channel_bits()  # [H, D]
    nh = c.n_hi(D)
    assert nh == 16 and bool(mx.all((bits == 4).sum(-1) == nh))
    # hi channels are the largest by mean |k|
    mag = mx.abs(k).mean(axis=(0, 2))
    assert bool(mx.all(mx.where(bits == 4, mag, mx.inf).min(-1) >= mx.where(bits == 2, mag, -mx.inf).max(-1)))
    dk, _ = c._dense()
    # relative error (per channel, over its range): hi channels ~ 1/5 of the lo channels'
    err = mx.sqrt(((dk - k) ** 2).mean(axis=(0, 2))) / (k.max(axis=(0, 2)) - k.min(axis=(0, 2)))
    hi_err = float(mx.where(bits == 4, err, 0).sum() / (bits == 4).sum())
    lo_err = float(mx.where(bits == 2, err, 0).sum() / (bits == 2).sum())
    assert hi_err < 0.4 * lo_err, (hi_err, lo_err)
    # the same channels at 2 bits (plain KIVI) have the larger error
    kivi = gq.dequantize_per_channel(*gq.quantize_per_channel(k, 2, G), 2, G)
    err2 = mx.sqrt(((kivi - k) ** 2).mean(axis=(0, 2))) / (k.max(axis=(0, 2)) - k.min(axis=(0, 2)))
    assert hi_err < 0.4 * float(mx.where(bits == 4, err2, 0).sum() / (bits == 4).sum())
    # bytes: (16*4 + 48*2)/8 + 4*64/32 = 28 key bytes, 2*64/8 + 4*64/32 = 24 value bytes per token per head
    budget = c.theoretical_bytes_per_token(D, D)
    assert budget == 28 + 24
    measured = c.used_nbytes / (B * H * T)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    arrays = sum(a.nbytes for a in (c.kh_codes, c.kh_scales, c.kh_biases, c.kl_codes, c.kl_scales, c.kl_biases))
    cap_g = c.kh_scales.shape[-1]  # groups allocated (>= T // G: the buffers grow with spare capacity)
    assert cap_g == c.kl_scales.shape[-1] >= T // G
    assert arrays == B * H * cap_g * (nh * (4 * 4 + 4) + (D - nh) * (4 * 2 + 4))  # real array bytes


# ------------------------------------------------------------------------------------- skvq
def test_skvq_window_and_sinks_exact_reorder_clip_lowers_error():
    B, H, D, G, W, S = 1, 2, 64, 16, 16, 5
    c = make("skvq", group_size=G, window=W, n_sink=S, bits_key=2, bits_value=2)
    # channel ranges spread over 20x, interleaved (plain groups mix small and large channels); heavy tails
    chan = mx.exp(mx.random.uniform(shape=(1, H, 1, D)) * 3.0)
    T = 400
    k = (rand(B, H, T, D) * chan + 0.3 * mx.random.laplace(shape=(B, H, T, D)) * chan).astype(mx.float16)
    v = rand(B, H, T, D, dtype=mx.float16)
    c.update_and_fetch(k[:, :, :300], v[:, :, :300])
    for t in range(300, T):
        c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert c.n_sink == S and W <= c.n_res < W + G and c.stored_rows() == T
    dk, dv = c._dense()
    nq = c.n_quant
    for d, x in ((dk, k), (dv, v)):  # sinks and the newest >= W tokens are bit-exact float16
        assert bool(mx.array_equal(d[:, :, :S], x[:, :, :S]))
        assert bool(mx.array_equal(d[:, :, S + nq :], x[:, :, S + nq :]))
    mid = k[:, :, S : S + nq].astype(mx.float32)
    err_skvq = float(mx.mean((dk[:, :, S : S + nq].astype(mx.float32) - mid) ** 2))
    plain = gq.dequantize(*gq.quantize(mid, 2, G), 2, G)
    err_plain = float(mx.mean((plain - mid) ** 2))
    assert err_skvq < 0.7 * err_plain, (err_skvq, err_plain)
    # each ingredient helps on its own
    for kw in ({"reorder": False}, {"clip_search": False}):
        c2 = make("skvq", group_size=G, window=W, n_sink=S, **kw)
        c2.update_and_fetch(k, v)
        e2 = float(mx.mean((c2._dense()[0][:, :, S : S + c2.n_quant].astype(mx.float32)
                            - k[:, :, S : S + c2.n_quant]) ** 2))
        assert err_skvq < e2 < err_plain * 1.02, (kw, err_skvq, e2, err_plain)
    assert bool(mx.all(c.k_alpha <= 1.0)) and bool(mx.any(c.k_alpha < 1.0))  # the search clipped somewhere


def test_skvq_bytes_per_token():
    B, H, D, T = 1, 2, 64, 4096
    c = make("skvq", bits_key=2, bits_value=2, group_size=32, window=16, n_sink=5)
    c.update_and_fetch(rand(B, H, T, D), rand(B, H, T, D))
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    budget = 2 * (2 * D / 8 + 4 * D / 32)  # 2-bit codes + fp16 scale/bias per 32 channels, K and V
    assert c.theoretical_bytes_per_token(D, D) == budget
    used = sum(a[:, :, : c.n_quant].nbytes for a in (c.k_codes, c.k_scales, c.k_biases, c.v_codes, c.v_scales,
                                                        c.v_biases))  # real arrays, filled rows
    assert used == B * H * c.n_quant * budget
    measured = c.used_nbytes / (B * H * T)  # + sinks, window, permutations, alphas
    assert abs(measured / budget - 1) < 0.10, (measured, budget)


# ------------------------------------------------------------------------------------- age_tiered
def _group_codes(c, t, i):
    """(K^T codes, scales, biases, V codes, scales, biases) of group ``i`` of tier ``t``."""
    G = c.group
    w = gq.words_per_group(c.tier_bits[t], G)
    k = [getattr(c, f"k{t}_{a}")[..., i * per : (i + 1) * per] for a, per in zip(("codes", "scales", "biases"),
                                                                                (w, 1, 1))]
    v = [getattr(c, f"v{t}_{a}")[:, :, i * G : (i + 1) * G] for a in ("codes", "scales", "biases")]
    return k + v


def test_age_tiered_boundaries_and_requantization_from_codes():
    B, H, D, G, R, M = 1, 2, 64, 16, 32, 64
    c = make("age_tiered", recent_boundary=R, mid_boundary=M, group_size=G)  # bits 8 / 4 / 2
    k, v = rand(B, H, 140, D), rand(B, H, 140, D)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    assert (c.n_old, c.n_mid, c.n_recent, c.n_res) == (2, 2, 2, 4)
    for t in range(100, 111):
        c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    before = copy.deepcopy(c)
    c.update_and_fetch(k[:, :, 111:112], v[:, :, 111:112])  # T = 112: one group crosses each boundary
    assert (c.n_old, c.n_mid, c.n_recent, c.n_res) == (3, 2, 2, 0)
    # recent (8-bit) group 0 of `before` -> mid group 1 now; mid (4-bit) group 0 of `before` -> old group 2,
    # each re-quantized from the stored codes (not from the float rows, which would give other codes)
    for src_t, dst_t, dst_i in ((2, 1, 1), (1, 0, 2)):
        kc, ks, kb, vc, vs, vb = _group_codes(before, src_t, 0)
        b_src, b_dst = before.tier_bits[src_t], c.tier_bits[dst_t]
        kt = gq.dequantize(kc, ks, kb, b_src, G)
        vv = gq.dequantize(vc, vs, vb, b_src, c.value_group(D))
        want = [*gq.quantize(kt, b_dst, G), *gq.quantize(vv, b_dst, c.value_group(D))]
        got = _group_codes(c, dst_t, dst_i)
        for x, y in zip(got, want):
            assert bool(mx.array_equal(x, y))
    direct = gq.quantize(k[:, :, 32:48].swapaxes(-1, -2), 2, G)  # from full precision: different codes
    assert not bool(mx.array_equal(_group_codes(c, 0, 2)[0], direct.codes))
    # the bits of every token follow its group's newest token's age
    T = c.stored_rows()
    bits = c.token_bits()
    for p in range(T):
        g_newest_age = T - ((p // G) + 1) * G if p < c.n_quant else 0
        want = 16 if p >= c.n_quant else 8 if g_newest_age < R else 4 if g_newest_age < M else 2
        assert bits[p] == want, (p, bits[p], want)
    assert all(b >= 8 for b in bits[T - R :]) and all(b >= 4 for b in bits[T - M :])


def test_age_tiered_bytes_follow_tier_mix():
    B, H, D, T = 1, 2, 64, 4096
    c = make("age_tiered", recent_boundary=128, mid_boundary=1024, group_size=32)
    c.update_and_fetch(rand(B, H, T - 40, D), rand(B, H, T - 40, D))
    for _ in range(40):
        c.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
    assert (c.n_old, c.n_mid, c.n_recent, c.n_res) == (96, 28, 4, 0)
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays())
    per = [2 * (b * D / 8 + 4 * D / 32) for b in (2, 4, 8)]  # K and V bytes per token per head per tier
    assert [c.tier_bytes_per_token(t, D, D) for t in range(3)] == per
    budget = (96 * per[0] + 28 * per[1] + 4 * per[2]) * 32 / T
    arrays = sum(getattr(c, f"{kv}{t}_{a}").nbytes for t in range(3) for kv in "kv" for a in ("codes", "scales",
                                                                                                 "biases"))
    assert arrays >= B * H * T * budget  # held arrays (with spare capacity) cover the tier mix
    measured = c.used_nbytes / (B * H * T)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    assert abs(arrays / (B * H * T) / budget - 1) < 0.15  # spare capacity of the grown buffers is bounded


# ------------------------------------------------------------------------------------- zipcache
def _zip_tokens(B=1, H=2, T=64, D=64):
    """Keys: 6 'salient' tokens aligned with the queries (channel 0) but of modest norm, 16
    'distractors' of large norm orthogonal to the queries (channel 1), the rest small noise."""
    e = mx.eye(D)
    sal_pos, dis_pos = [3, 11, 20, 33, 47, 58], [1, 5, 8, 14, 17, 23, 26, 29, 36, 39, 42, 45, 51, 54, 57, 62]
    which = mx.zeros((T,), dtype=mx.int32)
    which = which.at[mx.array(sal_pos)].add(1).at[mx.array(dis_pos)].add(2)
    k = 0.3 * rand(B, H, T, D)
    k = k + mx.where((which == 1)[:, None], 3.0 * e[0], 0.0) + mx.where((which == 2)[:, None], 6.0 * e[1], 0.0)
    return k, rand(B, H, T, D), sal_pos, dis_pos


@pytest.mark.parametrize("with_queries", [True, False])
def test_zipcache_salient_tokens_at_hi_bits(with_queries):
    B, H, T, D = 1, 2, 64, 64
    c = make("zipcache", hi_fraction=0.25, hi_bits=4, lo_bits=2, group_size=32)
    k, v, sal_pos, dis_pos = _zip_tokens(B, H, T, D)
    q = mx.broadcast_to(20.0 * mx.eye(D)[0], (B, 2 * H, T, D))
    K, V = c.update_and_fetch(k, v)
    if with_queries:  # the dispatch point hands the real queries to the cache
        dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal")
    K, V = c.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))  # next call compresses the prompt
    assert (c.n_quant, c.n_res, c.n_hi) == (64, 1, 16)
    assert c.saliency_source == ("attention" if with_queries else "key_norm")
    flag = c.is_hi[0, :, :T, 0]  # [H, T]
    hi = {p for p in range(T) if bool(mx.all(flag[:, p] == 1))}
    if with_queries:
        assert set(sal_pos) <= hi  # attention-salient tokens are the hi ones
    else:
        assert set(dis_pos) == hi  # the fallback only sees key norms: the distractors win
    # hi tokens are stored at 4 bits: 16 codes per uint32 word of the hi store, 8-word rows
    assert c.kh_codes.shape[-1] == 64 * 4 // 32 and c.kl_codes.shape[-1] == 64 * 2 // 32
    dk = c._dense()[0][:, :, :T]
    err = mx.sqrt((((dk - k) / mx.sqrt(mx.abs(k).max(axis=2, keepdims=True))) ** 2).mean(-1))[0]  # [H, T]
    e_hi = float(mx.where(flag == 1, err, 0).sum() / (flag == 1).sum())
    e_lo = float(mx.where(flag == 0, err, 0).sum() / (flag == 0).sum())
    assert e_hi < 0.5 * e_lo, (e_hi, e_lo)


def test_zipcache_long_first_chunk_in_tiles_equals_one_pass(monkeypatch):
    """A 200-query first chunk goes in 32 tiles of 7 query rows (``_attend_scored``): the attention output and the
    saliency sums equal one pass over the whole chunk (the tiling only bounds the memory)."""
    from veloxquant_mlx.cache.methods.quantization import zipcache

    dispatch.install()
    B, H, T, D = 1, 2, 200, 64
    k, v = rand(B, H, T, D), rand(B, H, T, D)
    q = 2.0 * rand(B, 2 * H, T, D)
    got = []
    for tile in (zipcache.SALIENCY_TILE, 1 << 20):  # tiles, then one pass
        monkeypatch.setattr(zipcache, "SALIENCY_TILE", tile)
        c = make("zipcache", group_size=32)
        K, V = c.update_and_fetch(k, v)
        out = dispatch.dispatched_sdpa(q, K, V, cache=c, scale=D**-0.5, mask="causal")
        got.append((out, c.sal_sum[:, :, :T, 0]))
    (o_tiles, s_tiles), (o_one, s_one) = got
    assert o_tiles.shape == (B, 2 * H, T, D)
    assert mx.allclose(o_tiles, o_one, atol=1e-5, rtol=1e-5)
    assert mx.allclose(s_tiles, s_one, atol=1e-4, rtol=1e-5)
    assert float(s_one.sum()) == pytest.approx(2 * H * T, rel=1e-4)  # each query's probabilities sum to one


def test_zipcache_long_later_chunk_in_tiles_equals_one_pass(monkeypatch):
    """A 200-query chunk after 100 tokens (96 of them compressed at its ``_store``) goes in tiles over the compressed
    past decoded once: the output and the saliency sums of the pending and new rows equal one pass (which held
    several [N, M] float32 arrays: 2.73x the plain cache's peak on SmolLM2, 2048 tokens in chunks of 1024)."""
    from veloxquant_mlx.cache.methods.quantization import zipcache

    dispatch.install()
    B, H, T0, T, D = 1, 2, 100, 200, 64
    k, v = rand(B, H, T0 + T, D), rand(B, H, T0 + T, D)
    q = 2.0 * rand(B, 2 * H, T0 + T, D)
    got = []
    for tile in (zipcache.SALIENCY_TILE, 1 << 20):  # tiles, then one pass
        monkeypatch.setattr(zipcache, "SALIENCY_TILE", tile)
        c = make("zipcache", group_size=32)
        K, V = c.update_and_fetch(k[:, :, :T0], v[:, :, :T0])
        dispatch.dispatched_sdpa(q[:, :, :T0], K, V, cache=c, scale=D**-0.5, mask="causal")
        K, V = c.update_and_fetch(k[:, :, T0:], v[:, :, T0:])
        assert c.n_quant == 96
        out = dispatch.dispatched_sdpa(q[:, :, T0:], K, V, cache=c, scale=D**-0.5, mask="causal")
        got.append((out, c.sal_sum[:, :, : c.n_res, 0]))
    (o_tiles, s_tiles), (o_one, s_one) = got
    assert o_tiles.shape == (B, 2 * H, T, D)
    assert mx.allclose(o_tiles, o_one, atol=1e-5, rtol=1e-5)
    assert mx.allclose(s_tiles, s_one, atol=1e-4, rtol=1e-5)


def test_zipcache_spec_properties_from_arrays():
    B, H, T, D = 1, 2, 4096, 64
    c = make("zipcache")  # 20% at 4 bits, 80% at 2 bits, values routed the same way
    c.update_and_fetch(rand(B, H, T, D), rand(B, H, T, D))
    c.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
    assert (c.n_quant, c.n_hi, c.n_res) == (T, round(0.2 * T), 1)
    nh, nl = c.n_hi, c.n_lo
    key_q = (nh * (4 * 64 // 8 + 4) + nl * (2 * 64 // 8 + 4)) * B * H  # codes + fp16 scale/bias per token
    flags, chan, pend = B * H * T, B * H * D * 2, B * H * 1 * D * 2
    assert c.compressed_key_bytes == key_q + flags + chan + pend
    assert c.compressed_value_bytes == key_q + pend
    assert c.baseline_key_bytes == B * H * T * (2 * 64 // 8 + 4) + pend
    assert c.fp16_key_bytes == B * H * (T + 1) * D * 2
    assert c.compression_ratio == c.fp16_key_bytes / c.compressed_key_bytes
    assert abs(c.effective_avg_bits - 8 * key_q / (B * H * T * D)) < 1e-9
    budget_k = (0.2 * 4 + 0.8 * 2) * D / 8 + 4 + 1  # mixed codes + scale/bias + routing flag
    measured = c.compressed_key_bytes / (B * H * T)
    assert abs(measured / budget_k - 1) < 0.10, (measured, budget_k)
    assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) >= c.used_nbytes
    assert c.res_k.shape[2] <= 32 and c.nbytes < 1.2 * c.used_nbytes  # the prompt-sized pending buffer is gone


def test_zipcache_values_unquantized_option():
    B, H, T, D = 1, 2, 96, 64
    c = make("zipcache", quantize_values=False)
    v = rand(B, H, T, D, dtype=mx.float16)
    c.update_and_fetch(rand(B, H, T, D, dtype=mx.float16), v)
    c.update_and_fetch(rand(B, H, 1, D, dtype=mx.float16), rand(B, H, 1, D, dtype=mx.float16))
    assert c.n_quant == T and c.vh_codes is None and c.vl_codes is None
    assert bool(mx.array_equal(c._dense()[1][:, :, :T], v))  # values kept float16, exact
    assert c.compressed_value_bytes == B * H * (T + 1) * D * 2
