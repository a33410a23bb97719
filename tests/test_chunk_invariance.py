"""Prefix reuse: every mlx_lm-protocol method's ``chunk_invariant`` and ``exact_trim`` flags are proved.

A server that reuses a saved prompt cache for a follow-up turn feeds the cache the conversation as
[prefill chunk, decode steps, trim to the shared prefix, prefill of the rest]. That equals a fresh run
only if (a) the cache's state does not depend on how the rows were split into calls
(``chunk_invariant``) and (b) ``trim(n)`` restores the state of a cache that never saw those n rows
(``exact_trim``). Each method class declares both; this module checks every declaration both ways:
a True flag must hold (outputs equal, tight tolerance), a False flag must be visible on the data
used here (some split, or the trim, gives different outputs, or the trim raises / returns fewer rows).

The caches are built by ``KVCacheBuilder.for_model`` on a tiny llama (so cross-layer coordinators
and per-layer schedules are set up as in a model), and driven the way mlx_lm's attention layers drive
them: one mask per forward pass from the first layer's ``make_mask``, then per layer
``update_and_fetch`` and the attention dispatch point (``dispatched_sdpa`` -> the cache's ``attend``,
the real-query path). Every layer gets fixed per-layer query/key/value rows, so the *same rows* reach
the caches whatever the split -- which is what the flags are about. (Running the model end to end
would not isolate that: a lossy cache changes what later layers compute for the prompt tokens
depending on the split -- e.g. KIVI attends a one-call prompt in full precision but a chunked one
partly over codes -- so later layers would receive different key/value rows even from a cache whose
state is split-invariant.)

The data has the structure the methods react to: adjacent layers correlated (cross-layer merging and
shared bases), a key outlier channel that moves after the first 48 positions (so anything calibrated
on the first block differs from a fit on the whole prompt), and budgets, groups and windows smaller
than the 120-token prompt (the settings: ``CONFIGS`` of tests/contract_table.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask

from contract_table import CONFIGS, D, MLX_LM_METHODS, N_LAYERS, layer_rows, method_class
from tiny_models import tiny_llama
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig, dispatch
from veloxquant_mlx.cache.dispatch import dispatched_sdpa

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # shared flat fields (vecinfer)

SCALE = D**-0.5
T = 120  # prompt rows
N_TRIM = 24  # decode rows appended, then trimmed
SPLITS = {  # ways to feed the same T rows
    "chunk+decode+chunk": [40] + [1] * 16 + [64],
    "chunk+decode": [72] + [1] * 48,
}
PROBE = [5, 1, 1]  # calls after the prompt whose outputs are compared
TOL = 1e-5  # float32 rows; a chunk-invariant cache differs at most by summation order
DIFFERS = 1e-3  # a False flag must show a difference at least this large


PROMPT = layer_rows(0, T + sum(PROBE))  # prompt rows, then the probe rows (same positions in every run)
DISCARDED = layer_rows(1, N_TRIM)  # rows of the decode steps that are trimmed away


def build(method):
    caches = KVCacheBuilder.for_model(tiny_llama(head_dim=D, n_layers=N_LAYERS),
                                      KVCacheConfig(method=method, **CONFIGS[method]))
    assert dispatch.installed()  # the flags are declared for the real-query path that for_model sets up
    return caches


def forward(caches, data, start, n):
    """One forward pass of n rows (rows start..start+n of ``data``), as mlx_lm's attention layers run it."""
    mask = create_attention_mask(mx.zeros((1, n, 1)), caches[0])  # as mlx_lm: from layer 0, shared
    outs = []
    for cache, (q, k, v) in zip(caches, data):
        sl = slice(start, start + n)
        keys, values = cache.update_and_fetch(k[:, :, sl], v[:, :, sl])
        outs.append(dispatched_sdpa(q[:, :, sl], keys, values, cache=cache, scale=SCALE, mask=mask))
    mx.eval(outs)
    return outs


def feed(caches, data, splits, start=0):
    for n in splits:
        forward(caches, data, start, n)
        start += n
    return start


def probe(caches, start=T):
    """Outputs of every layer for the probe calls that follow the prompt."""
    outs = []
    for n in PROBE:
        outs += forward(caches, PROMPT, start, n)
        start += n
    return outs


def max_diff(a, b):
    return max(float(mx.abs(x - y).max()) for x, y in zip(a, b))


_CACHE: dict = {}


def reference(method):
    """Probe outputs after the prompt fed in one call (computed once per method)."""
    if method not in _CACHE:
        caches = build(method)
        feed(caches, PROMPT, [T])
        _CACHE[method] = probe(caches)
    return _CACHE[method]


# ------------------------------------------------------------------------------------------ tests
def test_every_mlx_lm_method_is_covered_and_declares_both_flags():
    assert sorted(CONFIGS) == sorted(MLX_LM_METHODS)
    for method in MLX_LM_METHODS:
        cls = method_class(method)
        for flag in ("chunk_invariant", "exact_trim"):
            assert flag in vars(cls), f"{cls.__name__} ({method}) must declare {flag} in its own class body"
            assert isinstance(vars(cls)[flag], bool)


@pytest.mark.parametrize("method", MLX_LM_METHODS)
def test_chunk_invariant_flag(method):
    """True: any split of the prompt gives the one-call outputs for the later calls; False: some split
    (prefill chunk + decode steps + chunk, or chunk + decode steps) visibly differs."""
    ref = reference(method)
    diffs = {}
    for name, splits in SPLITS.items():
        caches = build(method)
        assert feed(caches, PROMPT, splits) == T
        diffs[name] = max_diff(ref, probe(caches))
    if method_class(method).chunk_invariant:
        assert max(diffs.values()) <= TOL, diffs
    else:
        assert max(diffs.values()) > DIFFERS, f"{method} declares chunk_invariant = False, yet {diffs}"


@pytest.mark.parametrize("method", MLX_LM_METHODS)
def test_exact_trim_flag(method):
    """True: T rows, N_TRIM decode rows, trim(N_TRIM) returns N_TRIM on every layer and the later calls
    give the outputs of a cache fed the T rows only. False: the trim raises ValueError (the method
    refuses an inexact trim), returns fewer rows, or the later outputs differ."""
    caches = build(method)
    feed(caches, PROMPT, [T])
    for i in range(N_TRIM):
        forward(caches, DISCARDED, i, 1)
    try:
        trimmed = [c.trim(N_TRIM) for c in caches]
    except ValueError:
        outcome = "raises"
    else:
        if trimmed != [N_TRIM] * N_LAYERS:
            outcome = f"returned {trimmed}"
        else:
            assert [c.offset for c in caches] == [T] * N_LAYERS
            diff = max_diff(reference(method), probe(caches))
            outcome = "equal" if diff <= TOL else f"differs by {diff:.3g}"
            if not method_class(method).exact_trim:
                assert diff > DIFFERS or diff <= TOL, diff  # never "almost": a real difference or none
    if method_class(method).exact_trim:
        assert outcome == "equal", outcome
    else:
        assert outcome != "equal", f"{method} declares exact_trim = False, yet the trim was exact"


def _docs_table() -> dict:
    """method -> (chunk_invariant, exact_trim, why not) from docs/ARCHITECTURE.md, "Prefix reuse"."""
    text = (Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Prefix reuse", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            assert cells[1] in ("yes", "no") and cells[2] in ("yes", "no"), line
            rows[cells[0].strip("`")] = (cells[1] == "yes", cells[2] == "yes", cells[3])
    return rows


DOCS = _docs_table()


def test_docs_table_matches_the_flags():
    assert sorted(DOCS) == sorted(MLX_LM_METHODS)
    for method in MLX_LM_METHODS:
        cls = method_class(method)
        assert DOCS[method][:2] == (cls.chunk_invariant, cls.exact_trim), method


RAISES_UNLESS_EXACT = "trim: raises if the trimmed rows completed a"
RAISING = [m for m, (_, exact, why) in DOCS.items() if not exact and RAISES_UNLESS_EXACT in why]
N_SMALL_TRIM = 3  # decode rows that stay in the float16 residual of every such method's configuration


def test_the_trims_documented_as_raising_are_listed():
    assert len(RAISING) >= 10 and "kivi" in RAISING
    flagged = [m for m in MLX_LM_METHODS if method_class(m).trim_exact_or_raises]
    assert sorted(flagged) == sorted(RAISING)  # the attribute a server reads agrees with the docs


@pytest.mark.parametrize("method", RAISING)
def test_trims_documented_as_raising_are_exact_when_they_do_not_raise(method):
    """Where the docs say the trim "raises if the trimmed rows completed a group", a trim of rows that
    are all still in the float16 residual returns n and is exact: the ValueError (seen in
    ``test_exact_trim_flag``) is the only way such a trim is not exact. The reference is a copy of the same caches
    before the trimmed steps: a fit on the GPU (vecinfer's k-means sums by atomic scatter-add) varies between runs in
    its last bits, which two separately built caches would show (1.2e-4 on an H200)."""
    caches = build(method)
    feed(caches, PROMPT, [T])
    untouched = copy.deepcopy(caches)
    for i in range(N_SMALL_TRIM):
        forward(caches, DISCARDED, i, 1)
    assert [c.trim(N_SMALL_TRIM) for c in caches] == [N_SMALL_TRIM] * N_LAYERS
    assert max_diff(probe(untouched), probe(caches)) <= TOL
