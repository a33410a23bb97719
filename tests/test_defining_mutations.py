"""Mutation check of the defining-property guards (issue 16 items 5-8).

Each entry of ``BREAKS`` removes the step a paper is named for -- as a one-line source substitution
in the method (``substitute``) or a monkeypatch of one function -- and runs that method's guard from
test_defining_properties.py, which must then fail -- at its defining assertion (named per break), not
at an incidental check. Each guard is also run unbroken here. A substitution whose source line has
changed fails loudly in ``substitute``; a monkeypatched function the method stopped calling shows up
as a guard that passes under its break. Runs in about half a minute on two CPU cores."""

from __future__ import annotations

import inspect
import textwrap
import traceback
import types

import pytest

import mlx.core as mx

from veloxquant_mlx.cache import dispatch, grouped
from veloxquant_mlx.cache.methods.eviction import kvzip, snapkv
from veloxquant_mlx.cache.methods.quantization import kvquant, turboquant_rvq, zipcache
from veloxquant_mlx.cache.primitives import groupquant as gq

import test_defining_properties as guards


def substitute(monkeypatch, owner, name: str, old: str, new: str) -> None:
    """Install ``owner.name`` recompiled from its own source with ``old`` replaced by ``new``.

    ``old`` must occur exactly once (else the break no longer describes the code: fail loudly). The
    function is compiled in its module's globals, inside a scope that defines ``__class__`` so that
    zero-argument ``super()`` still works."""
    fn = inspect.getattr_static(owner, name)
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"break does not apply: {old!r} occurs {src.count(old)}x in {owner.__name__}.{name}"
    body = textwrap.indent(src.replace(old, new), "    ")
    code = compile(f"def _make(__class__):\n{body}\n    return {name}\n", inspect.getsourcefile(fn), "exec")
    scope: dict = {}
    exec(code, fn.__globals__, scope)  # noqa: S102 -- the method's own source, one substitution
    monkeypatch.setattr(owner, name, scope["_make"](owner))


# ------------------------------------------------------------------------------------------ the breaks
def zipcache_accumulated(mp):
    """Saliency = accumulated attention (no division by the number of queries that saw the token)."""
    substitute(mp, zipcache.ZipCacheKVCache, "_saliency",
               "self.sal_sum[:, :, :f, 0] / mx.maximum(self.sal_cnt[:, :, :f, 0], 1.0)", "self.sal_sum[:, :, :f, 0]")


def kvzip_sum(mp):
    """Importance = sum over reconstruction queries instead of the max."""
    substitute(mp, kvzip.KVzipKVCache, "observe", ".max(axis=(2, 3))", ".sum(axis=(2, 3))")


def snapkv_unpooled(mp):
    """Votes used as they are, without the kernel-7 pooling."""
    substitute(mp, snapkv.SnapKVKVCache, "score", "return avg_pool_last(votes, POOL_KERNEL)", "return votes")


def snapkv_all_queries(mp):
    """Every query of the prompt votes (the protected window stays ``obs_window`` rows)."""
    substitute(mp, snapkv.SnapKVKVCache, "_init_layout", "self.recent = self.obs_window",
               "self.recent, self.obs_window = self.obs_window, 1 << 30")


def kivi_per_channel_values(mp):
    """Values quantized per channel over each G-token group (as KIVI's keys) before their per-token
    codes: a token's stored value then depends on the other tokens of its group."""
    G = guards.KIVI_GROUP

    def quantize(x, bits, group):
        if x.shape[2] % G == 0:  # value blocks: whole G-token groups
            x = gq.dequantize_per_channel(*gq.quantize_per_channel(x, bits, G), bits, G, mx.float32)
        return gq.quantize(x, bits, group)

    proxy = types.SimpleNamespace(**{n: getattr(gq, n) for n in dir(gq) if not n.startswith("__")})
    proxy.quantize = quantize
    mp.setattr(grouped, "gq", proxy)  # the KIVI layout quantizes in grouped.py


def turboquant_no_rotation(mp):
    """The identity instead of the random rotation (in encoding, decoding and attention alike)."""
    mp.setattr(turboquant_rvq, "_rotation", lambda dim, seed: mx.eye(dim, dtype=mx.float32))
    mp.setattr(turboquant_rvq, "_QUANTIZERS", {})


def kvquant_post_rope(mp):
    """The layer's RoPE is never read: keys are quantized after RoPE."""
    mp.setattr(kvquant.KVQuantKVCache, "bind_attention", lambda self, attn: None)


# name: (break, guard, the guard's assertion that must be the one failing -- not an incidental check)
BREAKS = {
    "zipcache_accumulated": (zipcache_accumulated,
                             guards.test_zipcache_hi_tokens_are_the_top_normalized_attention_not_the_top_accumulated,
                             "assert hi == normalized == set(salient)"),
    "kvzip_sum": (kvzip_sum, guards.test_kvzip_importance_is_the_max_over_reconstruction_queries,
                  "assert kept == set(range(n_sink)) | by_max"),
    "snapkv_unpooled": (snapkv_unpooled,
                        guards.test_snapkv_pools_the_window_votes_so_a_voted_token_keeps_its_neighbourhood,
                        "assert kept == top_set(np.where(body, pooled[h]"),
    "snapkv_all_queries": (snapkv_all_queries, guards.test_snapkv_only_the_observation_window_votes,
                           "assert set(needles) <= kept and not set(decoys) & kept"),
    "kivi_per_channel_values": (kivi_per_channel_values,
                                guards.test_kivi_values_are_quantized_per_token_and_keys_per_channel,
                                "assert np.array_equal(dv1[:, :, even], dv2[:, :, even])"),
    "turboquant_no_rotation": (turboquant_no_rotation,
                               guards.test_turboquant_rvq_rotation_makes_the_cache_distortion_input_independent,
                               "assert err < TQ_UPPER * 4.0**-b"),
    "kvquant_post_rope": (kvquant_post_rope, guards.test_kvquant_bound_to_the_layer_rope_quantizes_keys_before_it,
                          'assert errs["pre"] * 100 < errs["post"]'),
}


@pytest.fixture(autouse=True)
def _dispatch():
    dispatch.install()
    yield


@pytest.mark.parametrize("name", list(BREAKS))
def test_guard_passes_unbroken_and_fails_under_the_break(name, monkeypatch):
    apply, guard, assertion = BREAKS[name]
    guard()
    with monkeypatch.context() as mp:
        apply(mp)
        with pytest.raises(AssertionError) as failure:
            guard()
    failing = traceback.extract_tb(failure.tb)[-1].line
    assert failing.startswith(assertion), f"{name}: the guard failed elsewhere: {failing!r} ({failure.value})"
