"""The mlx_lm cache contract, once, for every KIVI-family / vector-quantization method.

Methods: kivi_sink, kitty, skvq, age_tiered, zipcache (test_quant_variants.py), kvquant, gear, adakv
(test_quant_mixed.py), cachegen, amc (test_cachegen_amc.py), anchorkv, nsnquant (test_anchor_nsn.py),
vecinfer, a2ats (test_vq_methods.py), waterfill (test_waterfill.py). Those modules keep each method's defining property and byte
formulas, and build their caches with ``make`` / ``config`` from the table below.

Contract checked here for every method: the factory builds the method's class (no ``bits`` attribute),
bad settings raise QuantizerConfigError naming the field, attention through the dispatch point equals
dense attention over what update_and_fetch returned (every mask kind, with and without sinks), the
dense path without the dispatch point gives the same logits, mlx_lm generation with chunked prefill on
tiny llama/qwen2/gemma3, save/load_prompt_cache and deepcopy continue bit-identically, nbytes is the
bytes of the arrays held, merge refuses, trim is exact or refused. KIVI-layout methods (``group``)
also keep whole quantized groups plus a float16 residual, trim whole groups exactly, and hold their
bytes-per-token budget."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import pytest

from veloxquant_mlx import _blas

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from veloxquant_mlx.cache import (  # noqa: E402
    BatchingNotSupported,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    QuantizerConfigError,
    dispatch,
)
from veloxquant_mlx.cache import options as O  # noqa: E402
from veloxquant_mlx.cache.base import method_info  # noqa: E402

from numerics import rounding_bounds  # noqa: E402
from tiny_models import ARCHS, VOCAB, greedy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vecinfer: key_sub_dim etc. are flat fields


@dataclass(frozen=True)
class Spec:
    cls: str  # class name in veloxquant_mlx.cache.methods.<module>
    module: str
    options: type
    defaults: dict = field(default_factory=dict)  # options given unless a test overrides them
    flat: dict = field(default_factory=dict)  # make() keyword -> (KVCacheConfig field, default)
    invalid: tuple = ()  # (make() keywords, the field QuantizerConfigError must name)
    dense_kw: dict = field(default_factory=dict)  # settings under which attend is dense attention
    group: int | None = None  # KIVI layout: whole quantized groups of this many rows + a float16 residual
    budget: float | None = None  # bytes per token per head at D=64 after 4096 tokens (defaults)
    resolved: dict = field(default_factory=dict)  # settings the 4096-token fill must resolve to
    loaded_nbytes_equal: bool = True  # a loaded cache holds the same nbytes (else: the same used_nbytes)
    query_saliency: bool = False  # compression depends on the real queries (not seen without dispatch)
    fallback_source: str = "key_norm"  # ``saliency_source`` of a cache that saw no queries
    deep_trim: str | None = None  # trim into compressed rows: "refuse", "exact", or None (either)


SPECS = {
    "kivi_sink": Spec("KIVISinkKVCache", "kivi_sink", O.KIVISinkOptions, flat={"bits": ("bit_width_inlier", 2)},
                      invalid=(({"bits": 5}, "bit_width_inlier"),)),
    "kitty": Spec("KittyKVCache", "kitty", O.KittyOptions, invalid=(({"hi_bit": 2, "lo_bit": 4}, "kitty_hi_bit"),)),
    "skvq": Spec("SKVQKVCache", "skvq", O.SKVQOptions, defaults={"window": 16}),
    "age_tiered": Spec("AgeTieredKVCache", "age_tiered", O.AgeTieredOptions,
                       defaults={"recent_boundary": 32, "mid_boundary": 64}),
    # saliency needs the real queries: with them (dispatch) it is normalized attention, without them the
    # key-norm fallback, so the compressed forms (and later logits) legitimately differ
    "zipcache": Spec("ZipCacheKVCache", "zipcache", O.ZipCacheOptions, query_saliency=True),
    "kvquant": Spec("KVQuantKVCache", "kvquant", O.KVQuantOptions, group=32,
                    invalid=(({"n_sink": 33}, "kvquant_n_sink"), ({"bits": 9}, "kvquant_bits"),
                             ({"outlier_fraction": 0.7}, "kvquant_outlier_fraction")),
                    budget=2 * 32 + 2 * 21 * 4 / 32),  # 3 bits: (24 + 8) per side + 21+21 sparse entries * 4 B / 32
    "gear": Spec("GEARKVCache", "gear", O.GEAROptions, group=32,
                 invalid=(({"bits": 0}, "gear_bits"), ({"sparse_fraction": 0.6}, "gear_sparse_fraction"),
                          ({"energy_threshold": 1.5}, "gear_energy_threshold")),
                 # 2 bits, rank 4 (energy-resolved, capped), k and v: codes 16+8, sparse 2.625, A 8, B^T 16
                 budget=2 * (16 + 8 + 2.625 + 8 + 16), resolved={"rank": 4}),
    "adakv": Spec("AdaKVKVCache", "adakv", O.AdaKVOptions, group=32,
                  invalid=(({"importance": "entropy"}, "adakv_importance"), ({"obs_window": 0}, "adakv_obs_window"),
                           ({"target_avg_bits": 5.0}, "adakv_target_avg_bits")),
                  budget=40 + 16 + 1),  # 2.5 bits average: 2.5*128/8 code bytes + 4 groups*4 + 1 order byte
    "cachegen": Spec("CacheGenKVCache", "cachegen", O.CacheGenOptions, group=32,
                     loaded_nbytes_equal=False,
                     invalid=(({"bits": 9}, "cachegen_bits"), ({"group_size": 1}, "cachegen_group_size"),
                              ({"layer_groups": 0}, "cachegen_layer_groups"),
                              ({"use_delta": "yes"}, "cachegen_use_delta")),
                     budget=2 * (40 + 72 / 32)),  # 4 bits: (32 + 8) per side + 8-bit anchors (64 + 8) / 32 per side
    "amc": Spec("AMCKVCache", "amc", O.AMCOptions, group=32, loaded_nbytes_equal=False,
                invalid=(({"k_high": -0.1}, "amc_k_high"), ({"group_size": 1}, "amc_group_size"),
                         ({"query_alpha": 2.0}, "amc_query_alpha"),
                         # options of the paper that are not built are refused, not ignored
                         ({"use_query_saliency": True}, "amc_use_query_saliency"),
                         ({"adaptive_thresholds": True}, "amc_adaptive_thresholds"),
                         ({"calib_variance": 0.5}, "amc_calib_variance")),
                budget=3.75 * 128 / 8 + 16 + 1),  # 6/10/16 of 32 tokens at 8/4/2 bits; 4 B per 32 channels; order
    "anchorkv": Spec("AnchorKVCache", "anchorkv", O.AnchorKVOptions, defaults={"window": 16},
                     invalid=(({"residual_bits": 9}, "anchorkv_residual_bits"),
                              ({"anchor_frac": 0.0}, "anchorkv_anchor_frac"),
                              ({"rho": 1.5}, "anchorkv_rho"), ({"theta": 1.0}, "anchorkv_theta"),
                              ({"window": 0}, "anchorkv_window"))),
    "nsnquant": Spec("NSNQuantKVCache", "nsnquant", O.NSNQuantOptions, defaults={"residual_length": 16},
                     invalid=(({"codebook_size": 100}, "nsn_codebook_size"),
                              ({"subvector_dim": 3}, "nsn_subvector_dim"),
                              ({"bits": 3, "subvector_dim": 4, "codebook_size": 256}, "nsn_bits"),
                              ({"residual_length": 0}, "nsn_residual_length"))),
    # small codebooks keep the tests fast; the defaults (12/8 bits) are measured in docs/RESULTS.md
    "vecinfer": Spec("VecInferKVCache", "vecinfer", O.VecInferOptions,
                     flat={"kbits": ("key_codebook_bits", 8), "vbits": ("value_codebook_bits", 6)},
                     invalid=(({"kbits": 17}, "key_codebook_bits"), ({"fused_sdpa_max_ctx": 0}, "fused_sdpa_max_ctx")),
                     deep_trim="refuse"),  # into the block the statistics were fitted on
    # a2ats attends to retrieved rows only at decode; with retrieval_fraction=1 every row is retrieved and its
    # attention must equal dense attention (the sparse case: test_vq_methods.py); rows are float16: trims exact
    "a2ats": Spec("A2ATSKVCache", "a2ats", O.A2ATSOptions, defaults={"window": 16},
                  invalid=(({"codebook_bits": 9}, "a2ats_codebook_bits"),
                           ({"retrieval_fraction": 0.0}, "a2ats_retrieval_fraction"), ({"beta": 2.0}, "a2ats_beta"),
                           ({"window": -1}, "a2ats_window")),
                  dense_kw={"retrieval_fraction": 1.0}, deep_trim="exact",
                  loaded_nbytes_equal=False),  # the last step's retrieved indices are held (counted), not saved
    # widths are allocated from the real queries (dispatch) or, without them, with equal weights: the
    # compressed forms legitimately differ between the two paths; values and keys reloaded bit-exactly
    "waterfill": Spec("WaterfillKVCache", "waterfill", O.WaterfillOptions, defaults={"residual_length": 16},
                      flat={"bits": ("bit_width_inlier", 4), "n_calib": ("n_calib_tokens", 32)},
                      invalid=(({"bits": 9}, "bit_width_inlier"), ({"n_calib": 0}, "n_calib_tokens"),
                               ({"bits": [4, 4]}, "bit_width_inlier")),
                      query_saliency=True, fallback_source="uniform", loaded_nbytes_equal=False),
}
METHODS = [m for m in SPECS if method_info(m).implemented]
KIVI_LAYOUT = [m for m in METHODS if SPECS[m].group]


def config(method, **kw):
    """The method's KVCacheConfig: flat fields and options from ``kw`` over the table's defaults."""
    s = SPECS[method]
    flat = {f: kw.pop(k, default) for k, (f, default) in s.flat.items()}
    opts = {**s.defaults, **kw}
    return KVCacheConfig(method=method, **flat, options=s.options(**opts) if opts else None)


def method_class(method):
    s = SPECS[method]
    return getattr(__import__(f"veloxquant_mlx.cache.methods.{s.module}", fromlist=[s.cls]), s.cls)


def make(method, head_dim=64, **kw):
    c = KVCacheFactory.create(config(method, **kw).replace(head_dim=head_dim))
    assert isinstance(c, method_class(method)) and not hasattr(c, "bits")
    return c


def caches_for(model, method, install=True, **kw):
    return KVCacheBuilder.for_model(model, config(method, **kw), install_dispatch=install)


def rand(*shape, dtype=mx.float32):
    return mx.random.normal(shape).astype(dtype)


def sdpa(q, k, v, mask, scale, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def run_chunks(model, caches, tokens, chunks):
    """Last-position logits (float32) of each chunk of ``tokens`` fed in turn."""
    out, i = [], 0
    for n in chunks:
        out.append(model(mx.array(tokens[i : i + n])[None], cache=caches)[0, -1].astype(mx.float32))
        i += n
    mx.eval(out)
    return out


def fill(cache, B, H, D, T, decode=40):
    """A prefill of T - decode rows, then ``decode`` single-row steps."""
    cache.update_and_fetch(rand(B, H, T - decode, D), rand(B, H, T - decode, D))
    for _ in range(decode):
        cache.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
    return cache


TOKENS = [(i * 37 + 11) % VOCAB for i in range(140)]


@functools.cache
def model_of(arch="llama"):
    """One tiny model per architecture for the whole module (inference never changes it)."""
    return ARCHS[arch]()


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(7)


def _kivi_layout(c, rows):
    """KIVI layout: whole groups quantized, the rest in the float16 residual."""
    G = SPECS[type(c).method_name].group
    if G:
        assert (c.n_quant, c.n_res) == (rows // G * G, rows % G), (c.n_quant, c.n_res, rows)


# ------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("method", METHODS)
def test_factory_builds_the_method_class_without_bits(method):
    c = make(method)
    assert type(c) is method_class(method) and type(c).method_name == method and not hasattr(c, "bits")


@pytest.mark.parametrize("method,kw,name", [(m, kw, name) for m in METHODS for kw, name in SPECS[m].invalid])
def test_invalid_setting_names_its_field(method, kw, name):
    with pytest.raises(QuantizerConfigError) as e:
        make(method, **kw)
    assert e.value.field == name


# ------------------------------------------------------------------------------------- attention
# every mask kind: mlx_lm's "causal" string, None (one row), its boolean array, that array with random
# holes (the diagonal kept), and an additive float mask
CASES = [(70, "causal"), (1, None), (1, None), (20, "random"), (1, None), (9, "additive"), (1, None), (20, "array"),
         (1, None), (40, "causal"), (1, None)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("use_sinks", [False, True])
def test_attend_through_dispatch_equals_dense_attention(method, use_sinks):
    B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
    cache = make(method, **SPECS[method].dense_kw)
    sinks = rand(Hq) if use_sinks else None
    for n, kind in CASES:
        k, v, q = rand(B, H, n, D), rand(B, H, n, D), rand(B, Hq, n, D)
        past = cache.stored_rows()
        if kind == "random":
            mask = cache.make_mask(n, return_array=True)
            mask = mask & (mx.random.uniform(shape=(B, Hq, n, past + n)) > 0.2) | (mx.eye(n, past + n, past) > 0)
        elif kind == "additive":
            mask = mx.where(cache.make_mask(n, return_array=True), 0.0, -mx.inf)
        else:
            mask = cache.make_mask(n, return_array=kind == "array")
        K, V = cache.update_and_fetch(k, v)
        assert K.shape[2] == past + n
        assert bool(mx.array_equal(K[:, :, past:], k)) and bool(mx.array_equal(V[:, :, past:], v))
        out = dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=mask, sinks=sinks)
        ref = sdpa(q, K, V, mask, scale, sinks)
        assert out.shape == (B, Hq, n, D)
        assert float(mx.abs(out - ref).max()) < 1e-4, (n, kind)
    assert cache.offset == sum(n for n, _ in CASES) == cache.stored_rows()
    _kivi_layout(cache, cache.offset)
    dk, dv = cache._dense()  # the stored form, in position order
    assert dk.shape == (B, H, cache.offset, D) and dv.shape == dk.shape


@pytest.mark.parametrize("method", METHODS)
def test_dense_path_without_dispatch_same_logits(method):
    """Without the dispatch point mlx_lm attends over the dense rows update_and_fetch returns."""
    model, chunks, kw = model_of(), [70, 1, 1, 1, 20, 1, 16, 1], SPECS[method].dense_kw
    dispatch.install()
    ca = caches_for(model, method, **kw)
    a = run_chunks(model, ca, TOKENS, chunks)
    dispatch.uninstall()
    cb = caches_for(model, method, install=False, **kw)
    b = run_chunks(model, cb, TOKENS, chunks)
    if SPECS[method].query_saliency:
        assert (ca[0].saliency_source, cb[0].saliency_source) == ("attention", SPECS[method].fallback_source)
        a, b = a[:1], b[:1]  # the prompt attends itself in full precision either way
    # the paths sum in different orders; a stored row on a float16 rounding edge then moves by an ulp, and
    # an element on a quantization boundary may round to the neighbouring code (seen for kvquant with
    # OpenBLAS off: 0.023 on one chunk); both are bounded by what the run itself measures (tests/numerics.py)
    for x, y, tol in zip(a, b, rounding_bounds(model, TOKENS, chunks, b)):
        assert float(mx.abs(x - y).max()) <= tol


# ------------------------------------------------------------------------------------- mlx_lm use
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_with_chunked_prefill(method, arch):
    model = model_of(arch)
    caches = caches_for(model, method)
    out = greedy(model, TOKENS[:75], caches, max_tokens=10, prefill_step_size=16)  # 75 > prefill step
    assert len(out) == 10 and all(0 <= t < VOCAB for t in out)
    ours = [c for c in caches if isinstance(c, method_class(method))]
    assert ours and all(type(c).method_name == method for c in ours)
    for c in ours:
        assert c.offset == 75 + 10 and c.stored_rows() == c.offset
        _kivi_layout(c, c.offset)


@pytest.mark.parametrize("method", METHODS)
def test_state_round_trip_deepcopy_nbytes_merge(method, tmp_path):
    model = model_of()
    caches = caches_for(model, method)
    run_chunks(model, caches, TOKENS, [70, 1, 1])
    for c in caches:  # nbytes: the bytes of the arrays held (with spare capacity), used_nbytes of the filled part
        assert c.nbytes == sum(a.nbytes for a in c.held_arrays()) >= c.used_nbytes
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    loaded = mlx_cache.load_prompt_cache(path)
    clone = copy.deepcopy(caches)
    assert all(type(c) is method_class(method) for c in caches + loaded)
    assert [c.used_nbytes for c in loaded] == [c.used_nbytes for c in caches]
    if SPECS[method].loaded_nbytes_equal:
        assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    nxt = TOKENS[72:80]
    la, lb, lc = (run_chunks(model, cs, nxt, [1] * 8) for cs in (caches, loaded, clone))
    for a, b, c in zip(la, lb, lc):
        assert bool(mx.array_equal(a, b)) and bool(mx.array_equal(a, c))
    with pytest.raises(BatchingNotSupported):
        method_class(method).merge(caches[:2])


# ------------------------------------------------------------------------------------- trim
@pytest.mark.parametrize("method", [m for m in METHODS if m not in KIVI_LAYOUT])  # those: the test below
def test_trim_exact_or_refused(method):
    k, v = rand(1, 2, 130, 64, dtype=mx.float16), rand(1, 2, 130, 64, dtype=mx.float16)

    def fed(chunks):
        c, i = make(method), 0
        for m in chunks:
            c.update_and_fetch(k[:, :, i : i + m], v[:, :, i : i + m])
            i += m
        return c

    c = fed([115] + [1] * 10)
    assert c.trim(3) == 3  # the newest rows are full precision in every method: exact
    ref = fed([115] + [1] * 7)
    assert c.offset == ref.offset == c.stored_rows()
    for x, y in zip(c._dense(), ref._dense()):
        assert bool(mx.array_equal(x, y))
    before, deep = c.offset, SPECS[method].deep_trim
    if deep == "refuse":
        with pytest.raises(ValueError):
            c.trim(77)
        assert c.offset == before
    elif deep == "exact":
        assert c.trim(77) == 77 and c.offset == 45
        for x, y in zip(c._dense(), fed([45])._dense()):
            assert bool(mx.array_equal(x, y))
    else:
        try:
            c.trim(77)
        except ValueError:
            assert c.offset == before  # refused: unchanged
        else:
            assert c.offset == 45


@pytest.mark.parametrize("method", KIVI_LAYOUT)
def test_trim_whole_groups_exact_partial_groups_refused(method):
    D = 64
    k, v = rand(1, 2, 136, D), rand(1, 2, 136, D)

    def fed(*chunks):
        c, i = make(method), 0
        for n in chunks:
            c.update_and_fetch(k[:, :, i : i + n], v[:, :, i : i + n])
            i += n
        return c

    def same(a, b):
        assert (a.offset, a.n_quant, a.n_res) == (b.offset, b.n_quant, b.n_res)
        for x, y in zip(a._dense(), b._dense()):
            assert bool(mx.array_equal(x, y))

    c = fed(104)
    assert c.trim(5) == 5
    same(c, fed(99))
    with pytest.raises(ValueError):
        c.trim(20)  # cuts into a quantized group
    c = fed(96, 32)  # 96 quantized by the prefill, group 3 by the second block
    assert c.trim(32) == 32
    same(c, fed(96))
    c = fed(104)
    assert c.trim(104) == 104 and c.empty()
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    same(c, fed(40))


# ------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("method", [m for m in KIVI_LAYOUT if SPECS[m].budget is not None])
def test_bytes_per_token_budget(method):
    B, H, D, T = 1, 2, 64, 4096
    cache = fill(make(method), B, H, D, T)
    assert cache.n_quant == T and cache.nbytes == sum(a.nbytes for a in cache.held_arrays())
    assert cache.used_nbytes <= cache.nbytes <= 1.2 * cache.used_nbytes
    measured = cache.used_nbytes / (B * H * T)
    budget = cache.bytes_per_token_budget(D, D)
    assert abs(measured / budget - 1) < 0.10, (measured, budget)
    assert budget == pytest.approx(SPECS[method].budget)
    assert {a: getattr(cache, a) for a in SPECS[method].resolved} == SPECS[method].resolved
