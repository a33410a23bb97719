"""KVCacheConfig against the spec, options, deprecation, validation, registry and factory errors."""

import ast
import dataclasses
import re
import warnings
from pathlib import Path

import pytest

from veloxquant_mlx.cache import (
    STANDALONE_METHODS,
    ArtifactStore,
    InMemoryArtifactStore,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    NpyDirectoryArtifactStore,
    QuantizationObserver,
    QuantizerConfigError,
    all_methods,
    options as opts,
)
from veloxquant_mlx.cache.config import _DEFAULTS

HERE = Path(__file__).parent
SPEC = HERE.parent.parent / "shared" / "spec" / "cache-api-reference.txt"


def _spec_signature() -> str:
    """The spec's KVCacheConfig signature: from ../shared when present, else the copy in tests/data."""
    if SPEC.exists():
        m = re.search(r"class veloxquant_mlx\.cache\.KVCacheConfig\((.*?)\)\[source\]", SPEC.read_text())
        return m.group(1)
    return (HERE / "data" / "kvcacheconfig_signature.txt").read_text().strip()


def _parse_signature(sig: str) -> dict:
    tree = ast.parse(f"def f({sig.replace('<factory>', 'None')}): pass")
    args = tree.body[0].args
    out = {}
    for a, d in zip(args.args, args.defaults):
        out[a.arg] = ast.literal_eval(d) if not isinstance(d, ast.Name) else d.id
    return out


def test_fields_and_defaults_match_the_spec_signature():
    spec = _parse_signature(_spec_signature())
    ours = [f.name for f in dataclasses.fields(KVCacheConfig)]
    assert ours == list(spec), "field order/names differ from the spec"
    for name, default in spec.items():
        if name == "observers":
            assert _DEFAULTS[name] == []
        else:
            assert _DEFAULTS[name] == default, name


def test_method_literal_lists_all_43_and_default_is_turboquant_rvq():
    """The spec's 43 methods, in its order, then the library's own ``waterfill``."""
    assert KVCacheConfig().method == "turboquant_rvq"
    names = [m.name for m in all_methods()]
    assert len(names) == 44 and len(set(names)) == 44 and names[-1] == "waterfill"
    assert STANDALONE_METHODS == {"turboquant_prod", "turboquant_mse", "polar", "qjl", "spectral"}


def test_options_populate_flat_fields_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = KVCacheConfig(method="snapkv", options=opts.SnapKVOptions(budget=100, obs_window=8))
    assert c.snap_budget == 100 and c.snap_obs_window == 8 and c.snap_n_sink == 4


def test_every_options_class_defaults_equal_flat_defaults():
    for cls in opts.ALL_OPTIONS:
        o = cls()
        for flat, value in o.flat_items():
            assert _DEFAULTS[flat] == value, (cls.__name__, flat)


def test_flat_field_emits_deprecation_naming_the_options_class():
    with pytest.warns(DeprecationWarning, match=r"H2OOptions\(budget=\.\.\.\)"):
        c = KVCacheConfig(method="h2o", h2o_budget=64)
    assert c.h2o_budget == 64


def test_a_flat_field_the_method_reads_outside_its_options_does_not_warn():
    """VecInfer's sub-vector dims and codebook widths are flat fields only (``SHARED_FIELDS``; TurboQuant-RVQ's
    options own them): setting them for vecinfer is not deprecated, and would be misdirected to
    TurboQuantRVQOptions; for turboquant_rvq the warning names its options class."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        c = KVCacheConfig(method="vecinfer", key_sub_dim=2, key_codebook_bits=10)
    assert c.key_sub_dim == 2 and c.key_codebook_bits == 10
    with pytest.warns(DeprecationWarning, match=r"TurboQuantRVQOptions\(key_sub_dim=\.\.\.\)"):
        KVCacheConfig(method="turboquant_rvq", key_sub_dim=2)


def test_options_for_the_wrong_method_is_rejected():
    with pytest.raises(QuantizerConfigError, match="options.*SnapKVOptions.*method='h2o'"):
        KVCacheConfig(method="h2o", options=opts.SnapKVOptions())


def test_conflicting_flat_and_options_value_is_rejected():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(QuantizerConfigError, match="snap_budget"):
            KVCacheConfig(method="snapkv", snap_budget=10, options=opts.SnapKVOptions(budget=20))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(method="nope"), "method"),
        (dict(head_dim=0), "head_dim"),
        (dict(bit_width_inlier=0), "bit_width_inlier"),
        (dict(bit_width_inlier=[4, 9]), "bit_width_inlier"),
        (dict(bit_width_inlier=True), "bit_width_inlier"),
        (dict(seed="x"), "seed"),
        (dict(options=opts.H2OOptions(decay=0.0), method="h2o"), "h2o_decay"),
        (dict(options=opts.CaMOptions(merge="blend"), method="cam"), "cam_merge"),
        (dict(options=opts.GEAROptions(sparse_fraction=1.5), method="gear"), "gear_sparse_fraction"),
        (dict(options=opts.SnapKVOptions(budget=0), method="snapkv"), "snap_budget"),
        (dict(options=opts.StreamingLLMOptions(n_sink=-1), method="streaming_llm"), "stream_n_sink"),
        (dict(options=opts.SVDqOptions(bit_schedule=(8, 99)), method="svdq"), "svdq_bit_schedule"),
        (dict(options=opts.KIVIOptions(group_size=2.5), method="kivi"), "kivi_group_size"),
        (dict(options=opts.RocketKVOptions(compression_ratio=1.0), method="rocketkv"), "rocketkv_compression_ratio"),
        (dict(options=opts.QFiltersOptions(on_low_retention="shout"), method="qfilters"), "qfilters_on_low_retention"),
        (dict(n_outlier_channels=128), "n_outlier_channels"),
        (dict(store="dir"), "store"),
    ],
)
def test_invalid_values_name_field_value_and_allowed(kwargs, field):
    with pytest.raises(QuantizerConfigError) as e:
        KVCacheConfig(**kwargs)
    assert e.value.field == field
    assert field in str(e.value) and "expected" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_factory_refuses_unimplemented_method_instead_of_falling_back(monkeypatch):
    from veloxquant_mlx.cache import base

    monkeypatch.delitem(base._CLASSES, "h2o")  # a registered method whose class is not built
    assert not base.method_info("h2o").implemented
    with pytest.raises(NotImplementedError, match="h2o.*not implemented"):
        KVCacheFactory.create(KVCacheConfig(method="h2o"))


def test_factory_rejects_per_layer_list():
    with pytest.raises(QuantizerConfigError, match="for_model"):
        KVCacheFactory.create(KVCacheConfig(method="snapkv", bit_width_inlier=[2, 4]))


def test_builder_validates_inputs():
    with pytest.raises(QuantizerConfigError, match="head_dim"):
        KVCacheBuilder().with_head_dim(96)
    with pytest.raises(QuantizerConfigError, match="capacity"):
        KVCacheBuilder().with_capacity(0)
    with pytest.raises(QuantizerConfigError, match="method"):
        KVCacheBuilder().with_method("bogus")
    with pytest.raises(QuantizerConfigError, match="store"):
        KVCacheBuilder().with_artifact_store("x")


def test_builder_takes_a_jl_dim_wider_than_the_head():
    """The spec's ``with_jl_dim`` says "<= head_dim" but advises m = 4 * head_dim (QJL's variance falls as 1/m):
    a wider sketch is built as asked; a non-positive one is refused naming the field."""
    cache = KVCacheBuilder().with_method("qjl").with_head_dim(64).with_jl_dim(256).build()
    assert cache.sketch.shape == (256, 64)
    with pytest.raises(QuantizerConfigError, match="jl_dim"):
        KVCacheBuilder().with_method("qjl").with_head_dim(64).with_jl_dim(0).build()


def test_builder_assembles_config_fields():
    obs = QuantizationObserver()
    b = (KVCacheBuilder().with_method("snapkv").with_head_dim(64).with_seed(7).with_capacity(100)
         .with_observer(obs).with_options(opts.SnapKVOptions(budget=32, obs_window=8)))
    c = b.config()
    assert (c.method, c.head_dim, c.seed, c.capacity, c.snap_budget, c.observers) == ("snapkv", 64, 7, 100, 32, [obs])
    cache = b.build()
    assert type(cache).__name__ == "SnapKVKVCache" and cache.budget == 32
    assert obs.events and obs.events[0].kind == "created"


def test_for_model_rejects_standalone_methods():
    import sys

    sys.path.insert(0, str(HERE))
    from tiny_models import tiny_llama

    for m in STANDALONE_METHODS:
        with pytest.raises(QuantizerConfigError, match="standalone"):
            KVCacheBuilder.for_model(tiny_llama(), KVCacheConfig(method=m))


@pytest.mark.parametrize("store_factory", [lambda p: InMemoryArtifactStore(), lambda p: NpyDirectoryArtifactStore(p)])
def test_artifact_stores_round_trip(tmp_path, store_factory):
    import mlx.core as mx

    store = store_factory(tmp_path)
    assert isinstance(store, ArtifactStore)
    calls = []
    make = lambda: calls.append(1) or mx.arange(6).reshape(2, 3).astype(mx.float32)
    a = store.get_or_create("rot.64.seed42", make)
    b = store.get_or_create("rot.64.seed42", make)
    assert calls == [1] and mx.array_equal(a, b)
    with pytest.raises(ValueError, match="artifact key"):
        store.put("../escape", a)


def test_flat_field_warnings_survive_interleaved_quiet_sections_in_threads():
    """Per-layer configs are built under ``_quiet_flat_fields`` on a server's request threads; two such
    sections interleaved (A enters, B enters, A leaves, B leaves) must not leave warnings off."""
    import threading

    from veloxquant_mlx.cache import config as C

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with C._quiet_flat_fields():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with C._quiet_flat_fields():
            b_in.set()
            a_out.wait(5)

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    with pytest.warns(DeprecationWarning, match="H2OOptions"):
        KVCacheConfig(method="h2o", h2o_budget=64)


def test_a_new_options_class_is_validated_and_aliased_from_its_one_declaration():
    """The reader's path "to add a method with a setting": a field is declared once, with what it accepts;
    its checks, its error text and (for a spec method, with ``flat_prefix``) its flat field follow."""
    from typing import Optional

    from veloxquant_mlx.cache.config import FIELD_RULES, flat_fields

    class ToyOptions(opts.MethodOptions, method="toy", evicts=True):
        budget: int = opts.tokens(64)
        mode: str = opts.one_of("fast", "exact")
        ratio: Optional[float] = opts.unit(None)

    assert ToyOptions.FIELDS == {} and ToyOptions.OPTION_ONLY == ("budget", "mode", "ratio", "decode_evict", "quantize")
    assert (ToyOptions().budget, ToyOptions(mode="exact", ratio=0.5).mode) == (64, "exact")
    for name, value, allowed in [("budget", 0, "an int in 1..1048576"), ("budget", True, "an int in 1..1048576"),
                                 ("mode", "slow", "one of 'fast', 'exact'"),
                                 ("ratio", 1.5, "a number in [0, 1] or None"),
                                 ("ratio", 10**400, "a number in [0, 1] or None"),  # no float holds it
                                 ("decode_evict", 1, "None (the method's default), True or False")]:
        with pytest.raises(QuantizerConfigError) as e:  # no flat field: checked when built, under its own name
            ToyOptions(**{name: value})
        assert (e.value.field, e.value.value, e.value.allowed) == (name, value, allowed)

    class ToyFlatOptions(opts.MethodOptions, method="toy", flat_prefix="toy"):
        budget: int = opts.tokens(64)
        n_sink: int = opts.tokens(4, lo=0, alias="toy_sinks")

    assert ToyFlatOptions.FIELDS == {"budget": "toy_budget", "n_sink": "toy_sinks"} and not ToyFlatOptions.OPTION_ONLY
    with pytest.raises(QuantizerConfigError) as e:  # built (the config reports it), checked under its flat name
        ToyFlatOptions(n_sink=-1).validate()
    assert (e.value.field, e.value.allowed) == ("toy_sinks", "an int in 0..1048576")
    flat = dataclasses.make_dataclass("Flat", flat_fields([ToyFlatOptions]))
    assert [(f.name, f.type, f.default) for f in dataclasses.fields(flat)] == [("toy_budget", int, 64),
                                                                              ("toy_sinks", int, 4)]

    class Clash(opts.MethodOptions, method="clash", flat_prefix="toy"):
        budget: int = opts.tokens(32)

    with pytest.raises(TypeError, match="toy_budget"):  # one flat field, two declarations that disagree
        flat_fields([ToyFlatOptions, Clash])
    with pytest.raises(TypeError, match="Bad.n: declare what it accepts"):  # a number needs its range

        class Bad(opts.MethodOptions, method="bad"):
            n: int = 3

    for cls in opts.ALL_OPTIONS:  # KVCacheConfig's flat fields are these declarations
        for name, flat_name in cls.FIELDS.items():
            assert FIELD_RULES[flat_name] == cls.RULES[name] and _DEFAULTS[flat_name] == getattr(cls(), name)


# --------------------------------------------------------------------------- bounds (issue 13 item 12)

_INT_FIELDS = [n for n, t in __import__("veloxquant_mlx.cache.config", fromlist=["_FIELD_TYPES"])._FIELD_TYPES.items()
               if "int" in t and "float" not in t and "bool" not in t and "tuple" not in t]


def test_int_field_list_covers_the_counted_fields():
    assert len(_INT_FIELDS) > 100 and {"kivi_group_size", "stream_window_size", "residual_length", "seed",
                                       "bit_width_inlier", "bit_width_outlier", "capacity"} <= set(_INT_FIELDS)


@pytest.mark.parametrize("value", [2**31, 10**12])
@pytest.mark.parametrize("name", _INT_FIELDS)
def test_every_int_field_refuses_huge_values_and_names_the_field(name, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(QuantizerConfigError) as exc:
            KVCacheConfig(**{name: value})
    assert exc.value.field == name and str(value) in str(exc.value)


# fields that another field bounds too (the options' check_relations): tried at their bound beside these values
_BOUND_WITH = {"kitty_lo_bit": {"kitty_hi_bit": 8}, "zipcache_lo_bits": {"zipcache_hi_bits": 8},
               "palu_lo_bit": {"palu_hi_bit": 8}, "age_bits_old": {"age_bits_mid": 8},
               "adakv_lo_bit": {"adakv_mid_bit": 7, "adakv_hi_bit": 8, "adakv_target_avg_bits": 7},
               "adakv_mid_bit": {"adakv_hi_bit": 8, "adakv_target_avg_bits": 7},
               "kvquant_n_sink": {"kvquant_group_size": 1024}, "gear_rank": {"gear_group_size": 1024}}


@pytest.mark.parametrize("name", _INT_FIELDS)
def test_every_int_field_accepts_its_default_and_upper_bound(name):
    from veloxquant_mlx.cache.config import FIELD_RULES

    KVCacheConfig(**{name: _DEFAULTS[name]})
    if name not in ("bit_width_inlier", "n_outlier_channels"):
        rule, with_ = FIELD_RULES[name], _BOUND_WITH.get(name, {})
        hi = max(rule.choices) if rule.kind == "choice" else rule.hi  # int choices: nsn_codebook_size, ...
        if name == "age_recent_boundary":
            hi = _DEFAULTS["age_mid_boundary"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            KVCacheConfig(**{name: hi}, **with_)
            with pytest.raises(QuantizerConfigError):
                KVCacheConfig(**{name: hi + 1}, **with_)


def test_float_fields_refuse_huge_values():
    for name in ("h2o_rope_base", "squeeze_strength", "nestedkv_kappa", "rocketkv_compression_ratio"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with pytest.raises(QuantizerConfigError, match=name):
                KVCacheConfig(**{name: 1e300})


@pytest.mark.parametrize("dtype", ["float16", "int32", "uint8", "complex64", 5, "bfloat16"])
def test_dtype_must_be_one_of_three_float_mlx_dtypes(dtype):
    import mlx.core as mx

    value = getattr(mx, dtype) if isinstance(dtype, str) else dtype
    with pytest.raises(QuantizerConfigError) as exc:
        KVCacheConfig(dtype=value if dtype in ("int32", "uint8", "complex64", 5) else str(dtype))
    assert exc.value.field == "dtype" and "float16" in str(exc.value) and "bfloat16" in str(exc.value)
    for ok in (None, mx.float16, mx.bfloat16, mx.float32):
        KVCacheConfig(dtype=ok)


def test_for_model_bounds_sub_dims_by_head_dim_and_layer_groups_by_layers():
    from tiny_models import tiny_llama

    model = tiny_llama(head_dim=16, n_layers=3)
    with pytest.raises(QuantizerConfigError, match=r"key_sub_dim.*1\.\.16.*head_dim"):
        KVCacheBuilder.for_model(model, KVCacheConfig(options=opts.TurboQuantRVQOptions(key_sub_dim=32)))
    with pytest.raises(QuantizerConfigError, match=r"xquant_group_size.*1\.\.3.*layer"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant", options=opts.XQuantOptions(group_size=4)))
    assert len(KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant",
                                                              options=opts.XQuantOptions(group_size=3)))) == 3
    # defaults fit any model: cachegen's 3 layer groups on a 2-layer model are "every layer"
    assert len(KVCacheBuilder.for_model(tiny_llama(n_layers=2), KVCacheConfig(method="cachegen"))) == 2


# --------------------------------------------------------------------------- which fields a method reads


def test_method_fields_accept_own_names_and_flat_aliases_and_refuse_other_methods():
    from veloxquant_mlx.cache.base import METHOD_NAMES

    for m in METHOD_NAMES:
        names = opts.method_fields(m)
        cls = opts.OPTIONS_BY_METHOD.get(m)
        for opt, flat in (cls.FIELDS.items() if cls else ()):
            assert names[flat] == flat
            assert names.get(opt) == flat or opt in opts.SHARED_FIELDS.get(m, ()), (m, opt)
    assert opts.method_fields("snapkv")["budget"] == "snap_budget"
    assert opts.method_fields("snapkv")["dtype"] == "dtype"  # the shared field keeps the name ...
    assert opts.method_fields("snapkv")["snap_dtype"] == "snap_dtype"  # ... the option keeps its alias
    assert opts.method_fields("nsnquant")["seed"] == "nsn_seed"  # nsnquant reads no shared seed
    assert "snap_budget" not in opts.method_fields("kivi")
    assert "bit_width_inlier" not in opts.method_fields("streaming_llm")
    assert "kivi_group_size" not in opts.method_fields("snapkv")


_READS: dict[str, str] = {}


def _recording_config_class():
    """A KVCacheConfig whose field reads by cache code land in ``_READS`` (field -> first file:line); reads
    by the builder, validation, ``replace`` and the state serializer are not the method's and are left out."""
    import sys

    fields = {f.name for f in dataclasses.fields(KVCacheConfig)}
    skip = ("factory.py", "config.py", "dataclasses.py")

    class Recording(KVCacheConfig):
        def __getattribute__(self, name):
            if name in fields:
                f = sys._getframe(1)
                if f.f_code.co_name != "config_to_json" and not f.f_code.co_filename.endswith(skip):
                    _READS.setdefault(name, f"{Path(f.f_code.co_filename).name}:{f.f_lineno}")
            return object.__getattribute__(self, name)

    return Recording


def test_shared_field_table_matches_what_each_standalone_method_reads():
    """Every shared field a standalone method accepts is read while it appends rows and attends (with
    outliers, calibration, a sketch and a capacity configured), and nothing it reads is refused."""
    import mlx.core as mx

    Recording = _recording_config_class()
    mx.random.seed(0)
    keys, values, q = mx.random.normal((48, 64)), mx.random.normal((48, 64)), mx.random.normal((64,))
    problems = []
    for m in sorted(STANDALONE_METHODS):
        _READS.clear()
        outliers = dict(n_outlier_channels=8, bit_width_outlier=3) if m.startswith("turboquant") else {}
        cache = KVCacheFactory.create(Recording(method=m, head_dim=64, bit_width_inlier=3, n_calib_tokens=16,
                                                capacity=64, jl_dim=64, **outliers))
        for k, v in zip(keys, values):
            cache.append_key(k)
            cache.append_value(v)
        mx.eval(cache.attend(q))
        # ``options``: the method's own options object (its fields are the settable options by construction)
        settable = set(opts.method_fields(m).values()) | {"method", "options"}
        problems += [f"{m} reads {f} ({where}) but does not accept it" for f, where in _READS.items()
                     if f not in settable]
        problems += [f"{m} accepts shared {f} but never reads it" for f in opts.SHARED_FIELDS[m] if f not in _READS]
    assert not problems, "\n".join(problems)
    assert "enable_vectorized_attend" not in opts.method_fields("turboquant_prod")  # a spec field nothing reads


def test_shared_field_table_matches_what_each_method_reads():
    """Record every KVCacheConfig read each mlx_lm-protocol method makes (build, chunked prefill past the
    512-token budgets, decode) on a tiny model: every field read must be settable for that method, and
    every shared field listed for it must be read."""
    import mlx.core as mx
    from tiny_models import greedy, tiny_llama

    from veloxquant_mlx.cache.base import METHOD_NAMES

    Recording = _recording_config_class()
    reads = _READS
    model = tiny_llama(head_dim=32)
    prompt = mx.random.randint(0, 128, (600,), key=mx.random.key(1)).tolist()
    problems = []
    for m in METHOD_NAMES:
        if m in STANDALONE_METHODS:
            continue
        reads.clear()
        greedy(model, prompt, KVCacheBuilder.for_model(model, Recording(method=m)), max_tokens=3,
               prefill_step_size=256)
        # ``options``: the method's own options object (its fields are the settable options by construction)
        settable = set(opts.method_fields(m).values()) | set(opts.DERIVED_FIELDS) | {"method", "head_dim", "options"}
        problems += [f"{m} reads {f} ({where}) but does not accept it" for f, where in reads.items()
                     if f not in settable]
        problems += [f"{m} accepts shared {f} but never reads it" for f in opts.SHARED_FIELDS.get(m, ())
                     if f not in reads]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- probes: replace, settings strings


def test_replace_with_new_options_replaces_the_old_options_values():
    c = KVCacheConfig(method="snapkv", options=opts.SnapKVOptions(budget=100, n_sink=2))
    d = c.replace(options=opts.SnapKVOptions(budget=200))
    assert (d.snap_budget, d.snap_n_sink, d.options.budget, d.options.n_sink) == (200, 4, 200, 4)
    assert c.replace(options=opts.SnapKVOptions()).snap_budget == 512
    r = KVCacheConfig(options=opts.TurboQuantRVQOptions(key_sub_dim=2)).replace(
        options=opts.TurboQuantRVQOptions(key_sub_dim=16))
    assert r.key_sub_dim == r.options.key_sub_dim == 16
    # a flat field changed with new options still changes them both
    e = c.replace(options=opts.SnapKVOptions(budget=200), snap_n_sink=8)
    assert (e.snap_budget, e.snap_n_sink, e.options.n_sink) == (200, 8, 8)
    with pytest.raises(QuantizerConfigError, match="options"):  # not an AttributeError
        c.replace(options={"budget": 3})


def test_for_model_refuses_a_sliding_window_it_would_ignore():
    from tiny_models import tiny_llama

    from veloxquant_mlx.cache.settings import method_config

    _, cfg = method_config("kivi", ["sliding_window=4"])
    with pytest.raises(QuantizerConfigError, match=r"sliding_window=4.*streaming_llm"):
        KVCacheBuilder.for_model(tiny_llama(), cfg, install_dispatch=False)


def test_build_config_refuses_unknown_settings_with_a_usage_error():
    from veloxquant_mlx.cache.settings import UsageError, build_config

    with pytest.raises(UsageError, match=r"snapkv.*'bugdet'"):
        build_config("snapkv", {"bugdet": 3})
    assert build_config("snapkv", {"budget": 64}).snap_budget == 64


def test_quantize_options_are_checked_with_the_config():
    with pytest.raises(QuantizerConfigError, match="kivi_group_size=0"):
        KVCacheConfig(method="snapkv", options=opts.SnapKVOptions(quantize=opts.KIVIOptions(group_size=0)))
    with pytest.raises(QuantizerConfigError, match="age_bits_mid=1"):
        KVCacheConfig(method="h2o", options=opts.H2OOptions(quantize=opts.AgeTieredOptions(bits_mid=1)))


def test_for_model_bounds_only_the_fields_the_method_reads():
    from tiny_models import tiny_llama

    model = tiny_llama(head_dim=4, n_layers=2)  # under turboquant_rvq's default value_sub_dim=8
    assert len(KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi"), install_dispatch=False)) == 2
    with pytest.raises(QuantizerConfigError, match=r"value_sub_dim=8.*1\.\.4.*head_dim"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="turboquant_rvq"), install_dispatch=False)
    with pytest.raises(QuantizerConfigError, match=r"value_sub_dim=8.*1\.\.4.*head_dim"):  # the quantizer's
        KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", options=opts.SnapKVOptions(
            quantize="turboquant_rvq")), install_dispatch=False)
    rvq = opts.TurboQuantRVQOptions(value_sub_dim=4)  # the quantizer's own value, not the flat default
    assert len(KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", options=opts.SnapKVOptions(
        quantize=rvq)), install_dispatch=False)) == 2


def test_parse_sets_refuses_one_setting_given_two_values():
    from veloxquant_mlx.cache.settings import UsageError, method_config, parse_sets

    with pytest.raises(UsageError, match=r"snap_budget.*twice.*64.*128"):
        method_config("snapkv", ["budget=64", "snap_budget=128"])
    with pytest.raises(UsageError, match=r"snap_budget.*twice"):
        parse_sets(["snap_budget=64", "snap_budget=32"])
    assert parse_sets(["budget=64", "snap_budget=64"], method="snapkv") == {"snap_budget": 64}  # the same value


def test_build_config_refuses_one_setting_given_two_values():
    """An option and its flat alias, or a quantizer's setting bare and scoped (``QUANTIZER:NAME``), with two
    values: a ``UsageError`` naming it and both values, not the last one kept."""
    from veloxquant_mlx.cache.settings import UsageError, build_config, method_config

    with pytest.raises(UsageError, match=r"'snap_budget' is set twice \(64 and 128\)"):
        build_config("snapkv", {"budget": 64, "snap_budget": 128})
    with pytest.raises(UsageError, match=r"'residual_length' is set twice \(16 and 32\)"):
        build_config("snapkv", {"quantize": "waterfill", "residual_length": 16, "waterfill:residual_length": 32})
    with pytest.raises(UsageError, match=r"'residual_length' is set twice \(16 and 32\)"):
        method_config("snapkv", ["quantize=waterfill", "residual_length=16", "waterfill:residual_length=32"])
    assert build_config("snapkv", {"budget": 64, "snap_budget": 64}).options.budget == 64
    c = build_config("snapkv", {"quantize": "waterfill", "residual_length": 16, "waterfill:residual_length": 16})
    assert c.options.quantize.residual_length == 16
