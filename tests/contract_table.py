"""The contract suite's one table of methods, and the helpers its test modules share.

Every mlx_lm-protocol method has one row in ``TABLE`` (a ``Case``): ``config``, the KVCacheConfig fields
under which it compresses the 120-token prompts of the model-level tables (budgets, groups and windows
below the prompt; test_chunk_invariance.py, test_contract.py, test_memory_honesty.py); ``unit``, for the
KIVI-family / vector-quantization methods, the single-layer settings and quirks of the quantization
contract (test_quant_contract.py); and the method's other quirks as data (``merges``, ``prepare``,
``loaded_nbytes_equal``, ``newest_trim_exact``, ``sparse_decode``, known library bugs) instead of copies of a
test body. Every standalone method has a row in
``STANDALONE`` (its shared checks: test_standalone_methods.py). ``chunk_invariant`` and ``exact_trim`` are
read from the classes, which declare them (proved both ways in test_chunk_invariance.py).
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import numpy as np
import pytest

from tiny_models import ARCHS, VOCAB
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, KVCacheFactory, all_methods
from veloxquant_mlx.cache import options as O
from veloxquant_mlx.cache.base import MLX_LM, method_info


@dataclass(frozen=True)
class Spec:
    cls: str  # the class name the factory builds
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



UNIT = {  # method -> Spec (the quantization contract's single-layer settings)
    "kivi_sink": Spec("KIVISinkKVCache", O.KIVISinkOptions, flat={"bits": ("bit_width_inlier", 2)},
                      invalid=(({"bits": 5}, "bit_width_inlier"),)),
    "kitty": Spec("KittyKVCache", O.KittyOptions, invalid=(({"hi_bit": 2, "lo_bit": 4}, "kitty_hi_bit"),)),
    "skvq": Spec("SKVQKVCache", O.SKVQOptions, defaults={"window": 16}),
    "age_tiered": Spec("AgeTieredKVCache", O.AgeTieredOptions,
                       defaults={"recent_boundary": 32, "mid_boundary": 64}),
    # saliency needs the real queries: with them (dispatch) it is normalized attention, without them the
    # key-norm fallback, so the compressed forms (and later logits) legitimately differ
    "zipcache": Spec("ZipCacheKVCache", O.ZipCacheOptions, query_saliency=True),
    "kvquant": Spec("KVQuantKVCache", O.KVQuantOptions, group=32,
                    invalid=(({"n_sink": 33}, "kvquant_n_sink"), ({"bits": 9}, "kvquant_bits"),
                             ({"outlier_fraction": 0.7}, "kvquant_outlier_fraction")),
                    budget=2 * 32 + 2 * 21 * 4 / 32),  # 3 bits: (24 + 8) per side + 21+21 sparse entries * 4 B / 32
    "gear": Spec("GEARKVCache", O.GEAROptions, group=32,
                 invalid=(({"bits": 0}, "gear_bits"), ({"sparse_fraction": 0.6}, "gear_sparse_fraction"),
                          ({"energy_threshold": 1.5}, "gear_energy_threshold")),
                 # 2 bits, rank 4 (energy-resolved, capped), k and v: codes 16+8, sparse 2.625, A 8, B^T 16
                 budget=2 * (16 + 8 + 2.625 + 8 + 16), resolved={"rank": 4}),
    "adakv": Spec("AdaKVKVCache", O.AdaKVOptions, group=32,
                  invalid=(({"importance": "entropy"}, "adakv_importance"), ({"obs_window": 0}, "adakv_obs_window"),
                           ({"target_avg_bits": 5.0}, "adakv_target_avg_bits")),
                  budget=40 + 16 + 1),  # 2.5 bits average: 2.5*128/8 code bytes + 4 groups*4 + 1 order byte
    "cachegen": Spec("CacheGenKVCache", O.CacheGenOptions, group=32,
                     loaded_nbytes_equal=False,
                     invalid=(({"bits": 9}, "cachegen_bits"), ({"group_size": 1}, "cachegen_group_size"),
                              ({"layer_groups": 0}, "cachegen_layer_groups"),
                              ({"use_delta": "yes"}, "cachegen_use_delta")),
                     budget=2 * (40 + 72 / 32)),  # 4 bits: (32 + 8) per side + 8-bit anchors (64 + 8) / 32 per side
    "amc": Spec("AMCKVCache", O.AMCOptions, group=32, loaded_nbytes_equal=False,
                invalid=(({"k_high": -0.1}, "amc_k_high"), ({"group_size": 1}, "amc_group_size"),
                         ({"query_alpha": 2.0}, "amc_query_alpha"),
                         # options of the paper that are not built are refused, not ignored
                         ({"use_query_saliency": True}, "amc_use_query_saliency"),
                         ({"adaptive_thresholds": True}, "amc_adaptive_thresholds"),
                         ({"calib_variance": 0.5}, "amc_calib_variance")),
                budget=3.75 * 128 / 8 + 16 + 1),  # 6/10/16 of 32 tokens at 8/4/2 bits; 4 B per 32 channels; order
    "anchorkv": Spec("AnchorKVCache", O.AnchorKVOptions, defaults={"window": 16},
                     invalid=(({"residual_bits": 9}, "anchorkv_residual_bits"),
                              ({"anchor_frac": 0.0}, "anchorkv_anchor_frac"),
                              ({"rho": 1.5}, "anchorkv_rho"), ({"theta": 1.0}, "anchorkv_theta"),
                              ({"window": 0}, "anchorkv_window"))),
    "nsnquant": Spec("NSNQuantKVCache", O.NSNQuantOptions, defaults={"residual_length": 16},
                     invalid=(({"codebook_size": 100}, "nsn_codebook_size"),
                              ({"subvector_dim": 3}, "nsn_subvector_dim"),
                              ({"bits": 3, "subvector_dim": 4, "codebook_size": 256}, "nsn_bits"),
                              ({"residual_length": 0}, "nsn_residual_length"))),
    # small codebooks keep the tests fast; the defaults (12/8 bits) are measured in docs/RESULTS.md (veloxquant eval)
    "vecinfer": Spec("VecInferKVCache", O.VecInferOptions,
                     flat={"kbits": ("key_codebook_bits", 8), "vbits": ("value_codebook_bits", 6)},
                     invalid=(({"kbits": 17}, "key_codebook_bits"), ({"fused_sdpa_max_ctx": 0}, "fused_sdpa_max_ctx")),
                     deep_trim="refuse"),  # into the block the statistics were fitted on
    # a2ats attends to retrieved rows only at decode; with retrieval_fraction=1 every row is retrieved and its
    # attention must equal dense attention (the sparse case: test_vq_methods.py); rows are float16: trims exact
    "a2ats": Spec("A2ATSKVCache", O.A2ATSOptions, defaults={"window": 16},
                  invalid=(({"codebook_bits": 9}, "a2ats_codebook_bits"),
                           ({"retrieval_fraction": 0.0}, "a2ats_retrieval_fraction"), ({"beta": 2.0}, "a2ats_beta"),
                           ({"window": -1}, "a2ats_window")),
                  dense_kw={"retrieval_fraction": 1.0}, deep_trim="exact",
                  loaded_nbytes_equal=False),  # the last step's retrieved indices are held (counted), not saved
    # widths are allocated from the real queries (dispatch) or, without them, with equal weights: the
    # compressed forms legitimately differ between the two paths; values and keys reloaded bit-exactly
    "waterfill": Spec("WaterfillKVCache", O.WaterfillOptions, defaults={"residual_length": 16},
                      flat={"bits": ("bit_width_inlier", 4), "n_calib": ("n_calib_tokens", 32)},
                      invalid=(({"bits": 9}, "bit_width_inlier"), ({"n_calib": 0}, "n_calib_tokens"),
                               ({"bits": [4, 4]}, "bit_width_inlier")),
                      query_saliency=True, fallback_source="uniform", loaded_nbytes_equal=False),
}

CONFIGS = {  # method -> KVCacheConfig fields for the 4-layer, head_dim 32, 120-token tables
    # quantization
    "turboquant_rvq": dict(key_codebook_bits=8, value_codebook_bits=6, residual_length=16),
    "vecinfer": dict(key_codebook_bits=6, value_codebook_bits=6),
    "kivi": dict(bit_width_inlier=2, options=O.KIVIOptions(group_size=16)),
    "kivi_sink": dict(bit_width_inlier=2, options=O.KIVISinkOptions(group_size=16, n_sink_tokens=3)),
    "kitty": dict(options=O.KittyOptions(group_size=16)),
    "adakv": dict(options=O.AdaKVOptions(group_size=16)),
    "kvquant": dict(options=O.KVQuantOptions(group_size=16)),
    "cachegen": dict(options=O.CacheGenOptions(group_size=16, bits=2)),
    "gear": dict(options=O.GEAROptions(group_size=32, energy_threshold=0.2)),
    "zipcache": dict(options=O.ZipCacheOptions(group_size=16)),
    "nsnquant": dict(options=O.NSNQuantOptions(residual_length=16, codebook_size=64, subvector_dim=4,
                                                bits=3)),
    "skvq": dict(options=O.SKVQOptions(window=16, group_size=16)),
    "amc": dict(options=O.AMCOptions(group_size=16)),
    "a2ats": dict(options=O.A2ATSOptions(window=16, codebook_bits=6, retrieval_fraction=0.3)),
    "anchorkv": dict(options=O.AnchorKVOptions(window=16)),
    "age_tiered": dict(options=O.AgeTieredOptions(recent_boundary=32, mid_boundary=64, group_size=16)),
    "waterfill": dict(bit_width_inlier=3, n_calib_tokens=32, options=O.WaterfillOptions(residual_length=16)),
    # cross-layer
    "svdq": dict(options=O.SVDqOptions(group_size=16)),
    "xquant": dict(options=O.XQuantOptions(group_quant_size=16)),
    "palu": dict(options=O.PaluOptions(group_size=16)),
    "minicache": dict(options=O.MiniCacheOptions(retention_threshold=0.9)),
    "xkv": dict(options=O.XKVOptions(group_quant_size=16)),
    "kvtc": dict(options=O.KVTCOptions(bit_budget=64)),
    # eviction
    "snapkv": dict(options=O.SnapKVOptions(budget=48, obs_window=8, n_sink=2)),
    "streaming_llm": dict(options=O.StreamingLLMOptions(n_sink=2, window_size=40)),
    "h2o": dict(options=O.H2OOptions(budget=48, n_sink=2, grace=8)),
    "tova": dict(options=O.TOVAOptions(budget=48, n_sink=2)),
    "pyramidkv": dict(options=O.PyramidKVOptions(budget=60, n_sink=2)),
    "squeeze": dict(options=O.SqueezeOptions(budget=60, n_sink=2)),
    "chunkkv": dict(options=O.ChunkKVOptions(budget=60, n_sink=2, chunk_size=4, reuse_layers=2)),
    "cam": dict(options=O.CaMOptions(budget=60, n_sink=2)),
    "knorm": dict(options=O.KNormOptions(budget=48, n_sink=2, recent=4)),
    "qfilters": dict(options=O.QFiltersOptions(budget=48, n_sink=2, calib_tokens=32, on_low_retention="ignore")),
    "keyformer": dict(options=O.KeyformerOptions(budget=48, n_sink=2, recent=4)),
    "morphkv": dict(options=O.MorphKVOptions(budget=48, n_sink=2, window=8)),
    "kvzip": dict(options=O.KVzipOptions(budget=48, n_sink=2)),
    "curdkv": dict(options=O.CurDKVOptions(budget=48, n_sink=2, rank_cap=8)),
    "nestedkv": dict(options=O.NestedKVOptions(budget=48, n_sink=2, window=8)),
    "rocketkv": dict(options=O.RocketKVOptions(compression_ratio=4.0, obs_window=8, n_sink=2)),
}


# quantized eviction (cache/composed.py): an eviction method's kept rows stored by a quantizer; a row's key
# is "EVICTION+QUANTIZER" (the config's method is the eviction method, its options name the quantizer)
COMPOSED = {
    "snapkv+waterfill": dict(bit_width_inlier=3, n_calib_tokens=32, options=O.SnapKVOptions(
        budget=48, obs_window=8, n_sink=2, quantize=O.WaterfillOptions(residual_length=16))),
    "pyramidkv+kivi": dict(bit_width_inlier=2, options=O.PyramidKVOptions(
        budget=60, n_sink=2, quantize=O.KIVIOptions(group_size=16))),
}


def base_method(key: str) -> str:
    """The registered method of a table key (``"snapkv+waterfill"`` -> ``"snapkv"``)."""
    return key.split("+")[0]


@dataclass(frozen=True)
class Case:
    config: dict  # KVCacheConfig fields of the model-level tables
    unit: Spec | None = None  # the quantization contract's settings (KIVI family, vector quantization)
    merges: bool = False  # merge() builds the method's batched form (else it raises BatchingNotSupported)
    prepare: Callable | None = None  # (model, caches, prompt tokens) after the prompt: a method's own pass
    loaded_nbytes_equal: bool = True  # a loaded / copied cache holds the same nbytes (else at most as many)
    newest_trim_exact: bool = True  # trim of the newest decode rows == a cache that never saw them
    sparse_decode: bool = False  # a single-row call attends a subset of the rows update_and_fetch returned


def _kvzip_compress(model, caches, tokens):
    from veloxquant_mlx.cache.methods.eviction.kvzip import kvzip_compress

    kvzip_compress(model, caches, mx.array(tokens), prompt_tokens=[5, 6])


MERGES = {"kivi", "turboquant_rvq", "streaming_llm", "waterfill"}  # their batched forms: test_*_batch.py
PREPARE = {"kvzip": _kvzip_compress}
LOADED_HOLDS_LESS = {  # a loaded or copied cache holds fewer bytes (the same used bytes), and why
    "turboquant_rvq": "only the used rows are saved, not the spare capacity",
    "snapkv+waterfill": "as waterfill (its quantizer)",
    "chunkkv": "a group leader's last kept indices are held for its followers, not saved",
    **{m: "see the Spec" for m, s in UNIT.items() if not s.loaded_nbytes_equal},
}
# Library bugs these tests expose (strict: the test fails again once fixed, so the mark has to go). The
# last one, chunkkv's lost layer-wise index reuse after load_prompt_cache, is fixed (groups relink on load).
LOAD_BUGS: dict[str, str] = {}  # method -> known bug of its loaded form (strict xfail); chunkkv's is fixed


def with_known_bugs(items, bugs, name=lambda m: m):
    """``items`` as pytest params, those whose method ``name(item)`` is in ``bugs`` marked xfail(strict=True)
    with the bug as the reason."""
    return [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=bugs[name(m)])) if name(m) in bugs else m
            for m in items]


# sparse decode attention: a single-row call attends a selected subset of the rows it returns (a2ats: the
# retrieved rows; rocketkv: the selected pages), so only multi-row calls equal dense attention over them
SPARSE_DECODE = {"a2ats", "rocketkv"}

# Host syncs inside a prefill chunk (test_contract.py::test_prefill_chunks_build_their_graph_without_a_host_sync):
# a value the host needs before it can build the rest of the graph, a data-dependent choice of shape. Every other
# method's chunk is sync-free apart from the bounded waits (contract.queue_chunk_check, primitives.blocks.wait_for);
# vecinfer's k-means evaluated its codebook after every iteration until session 36.
PREFILL_SYNCS = {  # method -> (the chunks of the test that sync, why)
    "svdq": (("first",), "chooses its rank from the first rows' energy spectrum"),
    "gear": (("first",), "chooses its low-rank size from the first rows' spectrum"),
    "xkv": (("first",), "chooses the shared rank from the first rows' spectrum"),
    "a2ats": (("first",), "builds its metric from the first chunk's queries on the host"),
    "squeeze": (("first",), "reads every layer's attention report once to split the budget"),
    "minicache": (("first", "second"), "the size of each merged block (rows kept apart) is a host count"),
    "kvtc": (("second",), "chooses its bit allocation from measured distortion when it first compresses"),
}

# per-step eviction: a row the trimmed steps evicted does not come back (the trim drops exactly the newest)
NEWEST_TRIM_DROPS_ONLY = {"streaming_llm", "tova", "morphkv"}
TABLE = {m: Case(cfg, unit=UNIT.get(m), merges=m in MERGES, prepare=PREPARE.get(m),
                 loaded_nbytes_equal=m not in LOADED_HOLDS_LESS, newest_trim_exact=m not in NEWEST_TRIM_DROPS_ONLY,
                 sparse_decode=m in SPARSE_DECODE)
         for m, cfg in {**CONFIGS, **COMPOSED}.items()}

MLX_LM_METHODS = [i.name for i in all_methods() if i.protocol == MLX_LM and i.implemented]
CONTRACT_METHODS = MLX_LM_METHODS + list(COMPOSED)  # test_contract.py: every method and the composed forms
SPECS = {m: TABLE[m].unit for m in UNIT}
QUANT_METHODS = [m for m in SPECS if method_info(m).implemented]
KIVI_LAYOUT = [m for m in QUANT_METHODS if SPECS[m].group]


def config(method, **kw):
    """The method's KVCacheConfig: flat fields and options from ``kw`` over the table's defaults."""
    s = SPECS[method]
    flat = {f: kw.pop(k, default) for k, (f, default) in s.flat.items()}
    opts = {**s.defaults, **kw}
    return KVCacheConfig(method=method, **flat, options=s.options(**opts) if opts else None)


def method_class(method):
    cls = method_info(base_method(method)).cls
    if method in COMPOSED:
        from veloxquant_mlx.cache.composed import composed_class

        return composed_class(cls)
    return cls


def make(method, head_dim=64, **kw):
    c = KVCacheFactory.create(config(method, **kw).replace(head_dim=head_dim))
    assert isinstance(c, method_class(method)) and type(c).__name__ == SPECS[method].cls and not hasattr(c, "bits")
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


def layer_call(cache, q, k, v):
    """What an mlx_lm attention layer does with a cache: the mask first, then update_and_fetch, then mlx_lm's
    sdpa (the cache's ``attend`` when the dispatch point is installed, MLX's kernel otherwise)."""
    mask = cache.make_mask(q.shape[2])
    keys, values = cache.update_and_fetch(k, v)
    return mlx_base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=q.shape[-1] ** -0.5, mask=mask)


def gather(x, pos):
    """Rows of ``x`` [B, H, T, D] at positions ``pos`` [B, H, n]."""
    return mx.take_along_axis(x, pos[..., None], axis=2)


def kl(p_logits, q_logits):
    """KL(p || q) of the next-token distributions of two logit vectors."""
    lp = p_logits - mx.logsumexp(p_logits, axis=-1, keepdims=True)
    lq = q_logits - mx.logsumexp(q_logits, axis=-1, keepdims=True)
    return float(mx.sum(mx.exp(lp) * (lp - lq)))


def exact_attention(q, k, v):
    """Softmax attention in NumPy: queries [n, D] over keys / values [T, D]."""
    s = q @ k.T / math.sqrt(k.shape[1])
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return w @ v


def cosine(a, b):
    """Cosine similarity of two arrays (flattened, float64)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


TOKENS = [(i * 37 + 11) % VOCAB for i in range(140)]


# ------------------------------------------------------------------------------- per-layer rows of a model
N_LAYERS, H, HQ, D = 4, 2, 4, 32  # the model-level tables' tiny llama: tiny_llama(head_dim=D, n_layers=N_LAYERS)


def layer_rows(seed: int, n: int):
    """Per layer of a N_LAYERS-layer model, (q [1, HQ, n, D], k [1, H, n, D], v [1, H, n, D]) float32 rows with
    the structure the methods react to: adjacent layers correlated, a key outlier channel that moves after
    position 48."""
    mx.random.seed(seed)
    shared_k = mx.random.normal((1, H, n, D))
    shared_v = mx.random.normal((1, H, n, D))
    pos = mx.arange(n)[:, None]
    ch = mx.arange(D)[None]
    # an outlier key channel that moves after position 48
    boost = mx.where((pos < 48) & (ch == 0), 8.0, 1.0) * mx.where((pos >= 48) & (ch == 5), 8.0, 1.0)
    out = []
    for _ in range(N_LAYERS):
        k = (shared_k + 0.25 * mx.random.normal((1, H, n, D))) * boost
        v = shared_v + 0.25 * mx.random.normal((1, H, n, D))
        q = mx.random.normal((1, HQ, n, D)) * 1.5
        out.append((q, k, v))
    mx.eval(out)
    return out


# ------------------------------------------------------------------------------------ standalone methods
@dataclass(frozen=True)
class Standalone:
    config: dict = field(default_factory=dict)  # settings over STANDALONE_FIELDS
    calibrated: bool = False  # fitted up front from low-rank rows (spectral bases)
    rotation: bool = False  # holds a random rotation drawn from ``seed`` (random_orthogonal(head_dim, seed))
    reads_jl_dim: bool = True  # validates ``jl_dim``


STANDALONE = {
    "polar": Standalone(rotation=True, reads_jl_dim=False),
    "qjl": Standalone(),
    "spectral": Standalone(calibrated=True),
    "turboquant_mse": Standalone({"bit_width_inlier": 2, "jl_dim": 128}, rotation=True, reads_jl_dim=False),
    "turboquant_prod": Standalone({"bit_width_inlier": 2, "jl_dim": 128}, rotation=True),
}


# Library bugs of the standalone caches (method -> reason; strict xfail): none known. TurboQuant's
# drop_oldest(-1) failed inside MLX until the standalone caches shared one base (StandaloneCache).
DROP_OLDEST_BUGS: dict[str, str] = {}


def standalone_config(method=None, **kw):
    """The plain config namespace a standalone cache reads its fields from: defaults, the method's row, ``kw``."""
    base = dict(head_dim=128, bit_width_inlier=4, bit_width_outlier=3, jl_dim=None, n_outlier_channels=None,
                n_calib_tokens=None, seed=42, dtype=None, capacity=None, observers=[], store=None,
                spectral_key_d_eff=4, spectral_val_d_eff=50, spectral_apply_qjl=True, spectral_model_name="model")
    return types.SimpleNamespace(**{**base, **(STANDALONE[method].config if method else {}), **kw})


def held_arrays(obj, seen=None):
    """Every mx.array reachable from a standalone cache through its own (package) objects and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    out = []
    if isinstance(obj, dict):
        for v in obj.values():
            out += held_arrays(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            out += held_arrays(v, seen)
    elif type(obj).__module__.startswith("veloxquant_mlx") and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            out += held_arrays(v, seen)
    return out


@functools.cache
def model_of(arch="llama"):
    """One tiny model per architecture for the whole session (inference never changes it)."""
    return ARCHS[arch]()


STANDALONE_METHODS = [i.name for i in all_methods() if i.protocol != MLX_LM and i.implemented]
