"""Bounded prefill: attention of a prefill chunk over the compressed past is an online softmax over
tiles (``attention.online_softmax_attention``), equal to the dense softmax, and a long chunked prefill
peaks no higher than mlx_lm's plain ``KVCache`` for the same model and prompt.

References are float64 numpy; tolerances come from the magnitudes involved (float32 epsilon times the
largest |logit| and |value| and the number of terms summed), not from one machine's rounding.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxquant_mlx.cache.attention as att
from peak_memory import peak_of
from tiny_models import VOCAB, tiny_llama
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, all_methods
from veloxquant_mlx.cache.base import MLX_LM
from veloxquant_mlx.cache.primitives import blocks
from veloxquant_mlx.eval.fidelity import prefill

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EPS32 = float(np.finfo(np.float32).eps)


def _reference(q, k, v, scale, mask, sinks):
    """float64 softmax attention over all keys; ``mask``: None, "causal" or a boolean [1, Hq, N, M] array."""
    q, k, v = (np.array(x, dtype=np.float64) for x in (q, k, v))
    B, Hq, N, _ = q.shape
    rep = Hq // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    M = k.shape[2]
    if isinstance(mask, str):
        s = np.where(np.arange(M)[None] <= (M - N + np.arange(N))[:, None], s, -np.inf)
    elif mask is not None:
        s = np.where(np.array(mask), s, -np.inf)
    if sinks is not None:
        col = np.broadcast_to(np.array(sinks, np.float64).reshape(1, Hq, 1, 1), (B, Hq, N, 1))
        s = np.concatenate([col, s], axis=-1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        p = p[..., 1:]
    finite = np.where(np.isfinite(s), np.abs(s), 0.0)
    return p @ v, float(finite.max()), M


def _tolerance(max_logit, n_keys, values):
    """Bound on float32 rounding of a softmax-weighted average: each logit carries ~eps * |logit| error
    (through exp that is a relative error of the weight), the sums add ~eps per term."""
    return 8 * EPS32 * (1 + max_logit + n_keys) * float(np.abs(np.array(values)).max())


@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("n,rep", [(1, 1), (7, 3), (13, 2)])
def test_online_softmax_equals_float64_reference(mask_kind, with_sinks, n, rep):
    B, H, D, M = 2, 2, 16, 61
    Hq = H * rep
    key = mx.random.key(n * 10 + rep)
    kq, kk, kv, km, ks = mx.random.split(key, 5)
    q = mx.random.normal((B, Hq, n, D), key=kq) * 2
    k = mx.random.normal((B, H, M, D), key=kk)
    v = mx.random.normal((B, H, M, D), key=kv)
    sinks = mx.random.normal((Hq,), key=ks) if with_sinks else None
    scale = D**-0.5
    ref_mask = mlx_mask = None
    if mask_kind == "causal":
        ref_mask = mlx_mask = "causal"
    elif mask_kind is not None:
        keep = mx.random.uniform(shape=(1, Hq, n, M), key=km) < 0.7  # mlx_lm's [B, Hq, N, M] layout
        keep[..., -1] = True  # every query sees at least one key
        ref_mask = keep
        mlx_mask = keep if mask_kind == "bool" else mx.where(keep, 0.0, -mx.inf)
    qf = (att.group_queries(q, H) * scale).reshape(B, H, rep * n, D)
    # two groups of keys split at an odd column, tiles of 5 rows (the last one shorter)
    blocks = att.dense_blocks(qf, k[:, :, :23], v[:, :, :23], 0, 5) + att.dense_blocks(
        qf, k[:, :, 23:], v[:, :, 23:], 23, 5)
    out = att.online_softmax_attention((B, H, rep, n), blocks, M, mlx_mask, sinks, mx.float32)
    ref, max_logit, n_keys = _reference(q, k, v, scale, ref_mask, sinks)
    assert out.shape == (B, Hq, n, D)
    assert np.abs(np.array(out) - ref).max() <= _tolerance(max_logit, n_keys, v)


def test_tile_rows_bounds_the_score_tile():
    # 1/16 of the dense score matrix, rounded down to whole groups
    assert att.tile_rows(4 * 512, 4096, 32) == 4096 // att.TILE_FRACTION
    assert att.tile_rows(4 * 512, 4096 + 100, 32) % 32 == 0
    # never below the minimum, never above the absolute cap of scores per tile
    assert att.tile_rows(8, 100) == att.TILE_MIN_ROWS
    rows = 32 * 2048
    assert att.tile_rows(rows, 1 << 17) * rows <= att.TILE_MAX_ELEMENTS
    assert att.tile_ranges(3, 20, 8) == [(3, 11), (11, 19), (19, 20)]


def test_query_tiles_keep_a_floor_of_rows_on_the_cpu(monkeypatch):
    """Query tiles (``dense_attention``, ``observed_attention``): ``block_entries()`` scores each, but on the CPU
    never fewer than ``CPU_TILE_FLOOR_ROWS`` rows (one-row tiles over 16K keys re-read the keys per row: an H2O
    chunk of 1024 rows 7.9 s against 3.4 s with the floor) and, to keep the floor's tiles several, never more than
    1/8 of the call; a call whose scores fit one block is one tile."""
    q = mx.zeros((1, 9, 1, 64))
    monkeypatch.setattr(att, "block_entries", lambda: 1 << 18)
    with mx.stream(mx.cpu):
        assert att.query_tile_rows(q, 1024, 16384) == att.CPU_TILE_FLOOR_ROWS  # 2^18 scores: 1 row
        assert att.query_tile_rows(q, 100, 16384) == 13  # 1/8 of a short call
        assert att.query_tile_rows(q, 4096, 512) == (1 << 18) // (9 * 512)  # above the floor: the scores decide
        assert att.query_tile_rows(q, 16, 64) >= 16  # fits: one tile (KVzip's reconstruction queries)


def test_blocks_are_waited_for_two_back_and_the_last_on_any_device(monkeypatch):
    """``queued_row_blocks``: the host waits for the block ``IN_FLIGHT`` back and for the last, on the CPU and on a
    GPU (``on_cpu`` stubbed) alike, so a long call cannot queue all its blocks' temporaries at once (an H100,
    SmolLM2's prompt in one chunk: vecinfer 6.9x the plain cache's peak with unwaited 2^24-entry blocks, 0.6x so);
    a GPU's blocks are larger. The results are the blocks' own; a call of one block is not waited for."""
    waited = []
    monkeypatch.setattr(blocks, "wait_for", lambda arrays: waited.append(int(arrays[0][0].item())))
    fn = lambda a, b: mx.arange(a, b)  # noqa: E731
    sizes = []
    for cpu in (False, True):
        waited.clear()
        monkeypatch.setattr(blocks, "on_cpu", lambda cpu=cpu: cpu)
        out = blocks.queued_row_blocks(fn, 50, 10)
        assert waited == [0, 10, 20, 40]
        assert mx.array_equal(mx.concatenate(out), mx.arange(50))
        sizes.append(blocks.block_entries())
    assert sizes == [blocks.BLOCK_ENTRIES_GPU, blocks.BLOCK_ENTRIES_CPU] and sizes[0] > sizes[1]
    assert blocks.queued_row_blocks(fn, 8, 10)[0].size == 8 and waited == [0, 10, 20, 40]


def test_a_gpu_block_is_a_share_of_its_call_so_a_small_models_search_stays_small(monkeypatch):
    """On a GPU (``on_cpu`` stubbed) a block is at most ``1 / GPU_BLOCK_SHARE`` of its call's entries, between the
    CPU's block and ``BLOCK_ENTRIES_GPU``; on the CPU always the CPU's. Measured on the CPU device: ``vq_assign`` of
    4096 pieces against 4096 codewords (67 MB of distances in all) under the GPU's policy peaks at the blocks that
    share allows (three 4 MB blocks queued), where three 16 MB blocks did before -- a tiny llama's vecinfer chunks on
    an H100 peaked at 2.2-3.0x the plain cache's prefill so (session 35)."""
    from veloxquant_mlx.cache.primitives.vq import vq_assign

    E_CPU, E_GPU, share = blocks.BLOCK_ENTRIES_CPU, blocks.BLOCK_ENTRIES_GPU, blocks.GPU_BLOCK_SHARE
    monkeypatch.setattr(blocks, "on_cpu", lambda: True)  # the CPU's rule on any machine (the suite runs on GPUs too)
    assert blocks.block_entries(1 << 40) == E_CPU
    monkeypatch.setattr(blocks, "on_cpu", lambda: False)
    assert blocks.block_entries() == E_GPU and blocks.block_entries(1 << 40) == E_GPU
    assert blocks.block_entries(1000) == E_CPU and blocks.block_entries(share << 20) == 1 << 20
    with mx.stream(mx.cpu):
        x = mx.random.normal((1, 4096, 4), key=mx.random.key(3))
        cb = mx.random.normal((1, 4096, 4), key=mx.random.key(4))
        mx.eval(x, cb)
        got, peak = peak_of(vq_assign, x, cb)
    whole = 4096 * 4096 * 4  # float32 distances of the call
    assert peak <= (blocks.IN_FLIGHT + 1) * whole / share + (2 << 20), f"{peak / 1e6:.1f} MB"
    d = ((x[0, :, None, :] - cb[0][None]) ** 2).sum(-1)
    chosen = mx.take_along_axis(d, got[0][:, None].astype(mx.int32), axis=1)[:, 0]
    assert float((chosen - d.min(axis=1)).max()) <= 1e-4 * float(d.max())


def test_a_gpu_tiles_a_call_with_an_array_mask_only(monkeypatch):
    """``dense_attention`` on a GPU (``on_cpu`` stubbed): a causal or no mask goes whole to MLX's fused kernel; an
    array mask (StreamingLLM's window) in tiles of query rows, the tiles' scores at most ``GPU_TILE_QUERY_MULTIPLE``
    times the query entries (and ``block_entries()`` at least) -- equal to the whole call to float32 round-off."""
    monkeypatch.setattr(blocks, "on_cpu", lambda: False)
    monkeypatch.setattr(att, "block_entries", lambda: 4096)
    tiles = []
    real = att.queued_row_blocks
    monkeypatch.setattr(att, "queued_row_blocks", lambda fn, n, rows: tiles.append(rows) or real(fn, n, rows))
    B, H, rep, N, D = 1, 2, 3, 150, 16
    q, k, v = (mx.random.normal((B, h, N, D), key=mx.random.key(i)) for i, h in enumerate((H * rep, H, H)))
    window = mx.arange(N)[:, None] - mx.arange(N)[None]
    for mask, tiled in (("causal", False), (None, False), ((window >= 0) & (window < 40), True)):
        tiles.clear()
        got = att.dense_attention(q, k, v, scale=D**-0.5, mask=mask)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
        assert bool(tiles) == tiled
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-4)
    rows = tiles[0]
    assert rows == max(4096, att.GPU_TILE_QUERY_MULTIPLE * q.size) // (B * H * rep * N) and rows < N
    big = mx.zeros((1, 32, 2048, 128))  # a large model's chunk: capped at GPU_TILE_MAX_ENTRIES
    assert att.query_tile_rows(big, 2048, 8192) == att.GPU_TILE_MAX_ENTRIES // (32 * 8192)


CHUNK_CONFIGS = {
    "kivi": dict(bit_width_inlier=4),
    "kivi_sink": dict(bit_width_inlier=4),  # a KIVI variant with its own storage hooks
    "turboquant_rvq": dict(residual_length=16),
    "waterfill": dict(bit_width_inlier=4, residual_length=16),
    "svdq": dict(),  # the low-rank caches: rows rebuilt from latents
    "vecinfer": dict(),  # rows decoded from product-quantized codes
}


@pytest.mark.parametrize("method", sorted(CHUNK_CONFIGS))
def test_tiled_prefill_chunk_equals_dense_softmax_over_stored_rows(method, monkeypatch):
    """Chunks of odd lengths after a stored past (sinks, quantized rows, window rows, the chunk's own
    rows; GQA 3:1; model sink logits): ``attend`` equals a float64 softmax over the rows that
    ``update_and_fetch`` returned in their stored form, with tiles forced small: KIVI's key tiles (many tile
    boundaries, none aligned with the groups), the window caches' tiles of query rows (``dense_attention``)."""
    monkeypatch.setattr(att, "TILE_FRACTION", 1 << 20)
    monkeypatch.setattr(att, "TILE_MIN_ROWS", 24)
    monkeypatch.setattr(att, "CPU_TILE_MIN_ROWS", 24)
    B, H, rep, D = 1, 2, 3, 16
    cache = KVCacheFactory.create(KVCacheConfig(method=method, head_dim=D, **CHUNK_CONFIGS[method]))
    key = mx.random.key(7)
    checked = 0
    for n in (203, 77, 45, 1, 91):
        key, kk, kv, kq, ks = mx.random.split(key, 5)
        k = mx.random.normal((B, H, n, D), key=kk)
        v = mx.random.normal((B, H, n, D), key=kv)
        q = mx.random.normal((B, H * rep, n, D), key=kq)
        sinks = mx.random.normal((H * rep,), key=ks)
        stored_before = cache.stored_rows()
        dk, dv = cache.update_and_fetch(k, v)
        out = cache.attend(q, dk, dv, scale=D**-0.5, mask="causal" if n > 1 else None, sinks=sinks)
        if n > 1 and stored_before:
            ref, max_logit, n_keys = _reference(q, dk, dv, D**-0.5, "causal", sinks)
            assert np.abs(np.array(out) - ref).max() <= _tolerance(max_logit, n_keys, dv)
            assert n_keys > 4 * att.TILE_MIN_ROWS  # several tiles
            checked += 1
    assert checked == 3


# ---------------------------------------------------------------------------------------- peak memory
PROMPT, CHUNK = 2048, 256
# every mlx_lm-protocol method (was 14 quantizers until session 31, when the rest were found above: vecinfer 13x,
# its chunks' LUT gather; the low-rank caches 4.3-5.2x; ZipCache's later chunks 2.7x on SmolLM2)
PEAK_METHODS = [i.name for i in all_methods() if i.implemented and i.protocol == MLX_LM]
# On a GPU, vecinfer's code search once held several 2^24-entry blocks of distances at once (H100, session 33: 212 MB
# against the plain cache's 26 MB here; sessions 34-35: 2.2-3.0x in 2^22-entry blocks). Since session 36 a CUDA
# search is one launch without the distances (``kernels.vq_nearest``; H200: both tests pass, SmolLM2 in one chunk
# 0.38x the plain cache's peak against 1.02x on the op path in the same run).
ON_GPU = mx.default_device().type == mx.DeviceType.gpu


def _prefill_peak(model, caches, prompt, step: int = None) -> int:
    """MLX's peak memory during a chunked prefill (as mlx_lm's generate_step does it; chunks of ``step``, default
    ``CHUNK``), above what was live before it (weights, the prompt, the empty caches)."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    prefill(model, prompt, caches, step or CHUNK)
    mx.synchronize()
    return mx.get_peak_memory() - base


@pytest.fixture(scope="module")
def peak_setup():
    model = tiny_llama(head_dim=16, n_layers=3)
    prompt = mx.array([(i * 37 + 11) % VOCAB for i in range(PROMPT)])
    plain = min(_prefill_peak(model, make_prompt_cache(model), prompt) for _ in range(2))
    return model, prompt, plain


@pytest.mark.parametrize("method", PEAK_METHODS)
def test_chunked_prefill_peaks_no_higher_than_the_plain_cache(method, peak_setup):
    """A 2048-token prompt in chunks of 256 on a tiny llama: the plain cache's peak is dominated by its
    [Hq, 256, up to 2048] float32 score matrices (the weights and its own rows are small); a compressed
    cache attending over its past must peak no higher. Measured after a first run, so process-wide
    constants built once (codebooks) are not counted."""
    model, prompt, plain = peak_setup
    config = KVCacheConfig(method=method, **CHUNK_CONFIGS.get(method, {}))
    _prefill_peak(model, KVCacheBuilder.for_model(model, config), prompt)
    caches = KVCacheBuilder.for_model(model, config)
    peak = _prefill_peak(model, caches, prompt)
    # the plain cache's score matrix of the last chunk alone: the test measures the regime it claims
    assert plain >= 4 * 256 * PROMPT * 4
    assert peak <= plain, f"{method}: prefill peak {peak} B above the plain cache's {plain} B"


# ---------------------------------------------------------------------------------------- short chats
from veloxquant_mlx.cache.contract import SHORT_PROMPT_SLACK_ROWS, short_prompt_bound  # noqa: E402
from veloxquant_mlx.measure import fp16_kv_bytes  # noqa: E402

MLX_LM_METHODS = [i.name for i in all_methods() if i.implemented and i.protocol == MLX_LM]
# Known to exceed the bound (strict: fixing one fails here): none. The last five were fixed by starting
# compression only once the compressed form is smaller than the rows it replaces (vecinfer's codebooks,
# palu's factors, kvtc's basis), qfilters' query accumulator only near its budget, and the low-rank
# code buffers reserving 1/32 spare groups instead of 16.
OVER_BOUND: set[str] = set()


def _model_constants(caches) -> int:
    return sum(c.constant_nbytes for c in caches
               if getattr(c, "counts_constants", False) and hasattr(c, "constant_nbytes"))


@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="known: holds more than the bound"))
    if m in OVER_BOUND else m for m in MLX_LM_METHODS])
def test_short_chat_holds_fp16_rows_plus_the_documented_constant(method):
    """Every mlx_lm-protocol method (quantizers, eviction, cross-layer), on a 40-token prompt then 8
    decode steps (a short chat, before most methods compress anything):
    nbytes <= the float16 rows of those tokens + SHORT_PROMPT_SLACK_ROWS rows per layer + the
    method's per-model constants (counted once). The 3.8 MB turboquant_rvq held on ~60-token chats
    was a 160-row window per layer (R + QUANT_BLOCK rows allocated up front)."""
    D, H, L = 32, 2, 3
    model = tiny_llama(head_dim=D, n_layers=L)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method))
    tokens = [(i * 29 + 5) % VOCAB for i in range(48)]
    mx.eval(model(mx.array(tokens[:40])[None], cache=caches))
    bound40 = short_prompt_bound(40, L, H, D, D) + _model_constants(caches)
    held40 = sum(c.nbytes for c in caches)
    for t in tokens[40:]:
        mx.eval(model(mx.array([[t]]), cache=caches))
    held48 = sum(c.nbytes for c in caches)
    bound48 = short_prompt_bound(48, L, H, D, D) + _model_constants(caches)
    assert fp16_kv_bytes(model, 48) + 2 * L * H * 2 * D * SHORT_PROMPT_SLACK_ROWS == short_prompt_bound(48, L, H, D, D)
    assert held40 <= bound40, f"{method}: {held40} B after 40 tokens, bound {bound40} B"
    assert held48 <= bound48, f"{method}: {held48} B after 48 tokens, bound {bound48} B"


def test_turboquant_rvq_extracted_from_a_batch_holds_only_its_window_rows():
    """The server's batch form hands each finished request back as a single cache: its window must hold
    the request's rows (and what the single cache grows by), not R + QUANT_BLOCK rows up front."""
    from veloxquant_mlx.cache.methods.quantization.turboquant_rvq import TurboQuantRVQKVCache

    D, H = 32, 2
    caches = [KVCacheFactory.create(KVCacheConfig(method="turboquant_rvq", head_dim=D)) for _ in range(2)]
    for i, c in enumerate(caches):
        n = 20 + 17 * i
        c.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    batch = TurboQuantRVQKVCache.merge(caches)
    one = batch.extract(1)
    assert one.n_win == 37 and one.win_k.shape[2] == 37
    assert one.nbytes <= short_prompt_bound(37, 1, H, D, D) + one.constant_nbytes


# ---------------------------------------------------------------------------------------- encoding cost
def test_smallest_k_finds_the_k_smallest_of_every_row():
    """The RVQ encoder's beam (``primitives.codebook.smallest_k``, two levels of argmins instead of
    MLX's slow CPU argpartition) picks exactly the k smallest entries of each row, also when they sit
    together in one column group, and for widths that do not split into groups."""
    from veloxquant_mlx.cache.primitives.codebook import smallest_k

    d = mx.random.normal((500, 256), key=mx.random.key(3))
    d[:7, 32:36] = -10.0  # the 4 smallest of some rows in one group of 16
    for x, k in ((d, 4), (d, 1), (d[:, :40], 3), (d[:, :48], 4)):
        got = np.sort(np.array(smallest_k(x, k)), axis=1)
        want = np.sort(np.argsort(np.array(x), axis=1, kind="stable")[:, :k], axis=1)
        assert got.shape == (x.shape[0], k)
        assert (got == want).all()


# ---------------------------------------------------------------------------------- a prompt in one chunk
ONE_CHUNK, ONE_CHUNK_LAYERS = 512, 6
ONE_CHUNK_SLACK = 1.10  # the compressed caches' own arrays (codes, windows, tables) are a few % of this peak
# Known to peak more than ONE_CHUNK_SLACK above the plain cache when a whole prompt is one chunk (strict: fixing one
# fails here): none since session 30. Fixed in session 29: ZipCache's first-chunk saliency pass in tiles (4.6x ->
# 1.83x here, 2.67x -> 0.81x on SmolLM2), and per-layer statistics that kept every layer's [N, N] probabilities or
# queries alive to the chunk's end (``mx.depends``: CaM and KVzip 9.2x -> 0.8x on SmolLM2 at 1023 tokens, waterfill
# 1.55x -> 1.04x), H2O's and NestedKV's decayed sums as a matmul, TOVA's last-row attention tied to the layer (here
# 1.46x / 1.46x / 3.2x -> 0.94-1.0x). In session 30: SqueezeAttention's hidden-state similarity tied to each layer's
# output (1.25x: it kept every layer's input and attention output to the last layer's report); work over many rows
# in blocks queued one by one with waits (``primitives.blocks``; MLX allocates at dispatch, ahead of the worker):
# the code searches (vecinfer 11x, turboquant_rvq 2.0x, a2ats 1.33x -> 0.94-0.99x), Keyformer's Gumbel softmax in
# tiles of query rows (2.0x -> 0.86x) and ZipCache's tiles (1.88x -> 0.71x; SmolLM2 0.63x).
ONE_CHUNK_OVER: set[str] = set()
# near the slack, either side from one run or machine to the next: none since session 30 (were gear 1.14-1.16x, now
# 0.36-0.41x with the low-rank prefill wait; morphkv 1.04-1.09x, its kept window of queries held each layer's queries)
ONE_CHUNK_BORDERLINE: set[str] = {"kivi_sink"} if ON_GPU else set()  # H100, session 33: 1.10x


def _one_chunk_param(m):
    if m in ONE_CHUNK_OVER:
        return pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="known: peaks above the bound"))
    if m in ONE_CHUNK_BORDERLINE:
        return pytest.param(m, marks=pytest.mark.xfail(strict=False, reason="known: near the bound"))
    return m


@pytest.fixture(scope="module")
def one_chunk_setup():
    model = tiny_llama(head_dim=16, n_layers=ONE_CHUNK_LAYERS)
    prompt = mx.array([(i * 37 + 11) % VOCAB for i in range(ONE_CHUNK)])
    peak = lambda: _prefill_peak(model, make_prompt_cache(model), prompt, step=ONE_CHUNK)  # noqa: E731
    return model, prompt, min(peak() for _ in range(2))


@pytest.mark.parametrize("method", [_one_chunk_param(m) for m in MLX_LM_METHODS])
def test_a_prompt_in_one_chunk_peaks_within_a_tenth_of_the_plain_cache(method, one_chunk_setup):
    """A 512-token prompt in one chunk (mlx_lm prefills prompts up to 2048 tokens so) on a 6-layer tiny llama: the
    plain cache's peak is one layer's [Hq, N, N] scores; a compressed cache must not keep a layer's probabilities,
    queries or encoding temporaries alive past that layer, nor build larger ones (1.5-11x when they do). Most
    quantizers sit 0-4% above the plain cache here, by run (their codes and windows beside the same scores): the
    bound allows ONE_CHUNK_SLACK; SmolLM2's figures are in docs/RESULTS.md."""
    model, prompt, plain = one_chunk_setup
    config = KVCacheConfig(method=method)
    _prefill_peak(model, KVCacheBuilder.for_model(model, config), prompt, step=ONE_CHUNK)
    peak = _prefill_peak(model, KVCacheBuilder.for_model(model, config), prompt, step=ONE_CHUNK)
    assert plain >= 4 * ONE_CHUNK * ONE_CHUNK * 4  # the regime the test claims: one layer's scores at least
    assert peak <= ONE_CHUNK_SLACK * plain, \
        f"{method}: one-chunk prefill peak {peak} B, {peak / plain:.2f}x the plain cache's {plain} B"


@pytest.mark.parametrize("mask, extra, sinks", [("causal", 0, False), ("causal", 300, False), (None, 0, False),
                                                ("causal", 0, True), ("window", 300, False)])
def test_a_long_call_is_attended_in_tiles_on_the_cpu_exactly_and_within_a_fraction_of_the_scores(mask, extra, sinks):
    """``attention.dense_attention``: a 700-row call over 700 + ``extra`` keys (a causal mask bottom-right aligned,
    none, or an array cut to each tile's rows; with attention sinks) equals MLX's sdpa, and on the CPU peaks at most half what MLX's sdpa does (it
    builds the call's [Hq, N, M] float32 scores and probabilities at once; the tiles ~1/4-1/5 of that)."""
    from veloxquant_mlx.cache.attention import dense_attention

    N, M, Hq, H, D = 700, 700 + extra, 8, 2, 32
    q = mx.random.normal((1, Hq, N, D), key=mx.random.key(1))
    k, v = (mx.random.normal((1, H, M, D), key=mx.random.key(i)) for i in (2, 3))
    s = mx.random.normal((Hq,), key=mx.random.key(4)) if sinks else None
    if mask == "window":  # an array mask (StreamingLLM's kind): causal, the 256 newest keys of each row
        i, j = mx.arange(extra, M)[:, None], mx.arange(M)[None]
        mask = (j <= i) & (i - j < 256)
    mx.eval(q, k, v, s)

    args = dict(scale=D**-0.5, mask=mask, sinks=s)
    want, sdpa_peak = peak_of(mx.fast.scaled_dot_product_attention, q, k, v, **args)
    got, peak = peak_of(dense_attention, q, k, v, **args)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-4)
    if mx.default_device() == mx.cpu:
        assert sdpa_peak >= Hq * N * M * 4 and peak <= 0.5 * sdpa_peak, (peak, sdpa_peak)
