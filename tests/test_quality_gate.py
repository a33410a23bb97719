"""CI quality gate: next-token fidelity of three methods on the embedded SmolLM2-135M, against fixed
thresholds, so that a quality regression fails CI.

Setting: the first 512 + 32 tokens of the Paul Graham essays; the 512-token context is prefilled through
each cache, then 32 tokens are scored one decode step at a time (``veloxquant_mlx.eval.tasks.eval_kld``:
mean KL divergence vs the uncompressed model, top-1 agreement, perplexity, measured KV bytes).

Values measured when the gate was set (mlx 0.32.4 CPU, float32 compute):

=================================  =======  =====  ===========  ===========
method                             KLD      top-1  ppl (ref)    compression
=================================  =======  =====  ===========  ===========
kivi bit_width_inlier=4            0.0074   1.000  18.43 (18.99)  2.77x
snapkv budget=256                  0.0199   0.938  19.22          1.85x
streaming_llm window_size=256      0.0740   0.875  19.38          1.83x
=================================  =======  =====  ===========  ===========

Thresholds leave margin for numerical noise (KLD about 2x the measured value, top-1 one or two tokens of
32 below it, compression about 10% below it, perplexity within a few percent of the uncompressed model's), but
a method that loses the information the gate measures (a 2-bit KIVI, random eviction, a broken window)
fails. StreamingLLM runs with a 256-token window, so that at this context it evicts like SnapKV does; its
bytes depend on where the run ends in its eviction cycle (it evicts in batches of max(16, window/8) rows).
"""

from __future__ import annotations

import pytest

import veloxquant_mlx  # noqa: F401,I001  (first: OpenBLAS before mlx)

from veloxquant_mlx.eval.specs import MethodSpec  # noqa: E402
from veloxquant_mlx.eval.tasks import eval_kld  # noqa: E402

CONTEXT, N_SCORE = 512, 32

# label: (spec, max KLD, min top-1, max |ppl/ppl_ref - 1|, max kv_fraction_of_fp16)
GATE = {
    "kivi": (MethodSpec("kivi", {"bit_width_inlier": 4}), 0.02, 0.93, 0.06, 1 / 2.5),
    "snapkv": (MethodSpec("snapkv", {"snap_budget": 256}), 0.045, 0.87, 0.05, 1 / 1.7),
    "streaming_llm": (MethodSpec("streaming_llm", {"stream_window_size": 256}), 0.15, 0.80, 0.06, 1 / 1.65),
}


@pytest.fixture(scope="module")
def gate_rows():
    from veloxquant_mlx.model import load_model

    model, tokenizer = load_model()
    rows = eval_kld(model, tokenizer, [spec for spec, *_ in GATE.values()], context=CONTEXT, n_score=N_SCORE,
                    include_none=False)
    return {r["method"]: r for r in rows}


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("method", list(GATE))
def test_quality_gate(gate_rows, method):
    _, max_kld, min_top1, max_ppl_rel, max_fraction = GATE[method]
    r = gate_rows[method]
    summary = (f"{r['label']}: KLD {r['kld']:.4f}, top-1 {r['top1_agree']:.3f}, ppl {r['ppl']:.2f} "
               f"(uncompressed {r['ppl_ref']:.2f}), kv_fraction_of_fp16 {r['kv_fraction_of_fp16']:.3f}")
    print(summary)
    assert r["error"] is None, r["error"]
    assert r["n_scored"] == N_SCORE
    assert 17.0 < r["ppl_ref"] < 21.0, f"the uncompressed reference itself moved: {summary}"
    assert r["kld"] <= max_kld, f"KLD regression: {summary} (gate {max_kld})"
    assert r["top1_agree"] >= min_top1, f"top-1 agreement regression: {summary} (gate {min_top1})"
    assert abs(r["ppl"] / r["ppl_ref"] - 1) <= max_ppl_rel, f"perplexity regression: {summary}"
    assert r["kv_fraction_of_fp16"] <= max_fraction, f"bytes regression: {summary} (gate {max_fraction:.3f})"



# ------------------------------------------------------------------------------------------------
# 4-bit class target (next-token KLD <= 0.002 nats at whole-cache bytes <= 0.30x fp16; docs/RESULTS.md,
# "4-bit class target"; veloxquant eval --task kld). Met by waterfill at 4 bits with a 16-row window at
# the gate's context (1024 tokens + 32 scored decode steps): this test holds the target itself, both
# halves, plus top-1 agreement within one token of the measured value.
#
# Measured when set (mlx 0.32.4 CPU, float32 compute): KLD 0.0012, top-1 0.906, kv/fp16 0.296.
TARGET4_CONTEXT = 1024
TARGET4_MAX_KLD = 0.002
TARGET4_MIN_TOP1 = 0.87
TARGET4_MAX_BYTES = 0.30


def _waterfill_point(bits: int, context: int, residual_length: int = 16):
    """Waterfill at ``bits`` with a float16 window of ``residual_length`` rows on the embedded model: ``context``
    essay tokens prefilled, N_SCORE scored decode steps (``next_token_fidelity``); (result, one-line summary)."""
    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.cache import KVCacheConfig
    from veloxquant_mlx.cache.options import WaterfillOptions
    from veloxquant_mlx.eval.fidelity import next_token_fidelity
    from veloxquant_mlx.model import load_model

    model, tok = load_model()
    n = context + N_SCORE
    ids = tok.encode(essays_text(max_chars=8 * n), add_special_tokens=False)[:n]
    cfg = KVCacheConfig(method="waterfill", bit_width_inlier=bits,
                        options=WaterfillOptions(residual_length=residual_length))
    r = next_token_fidelity(model, ids, context, N_SCORE, cfg)
    summary = f"KLD {r.kld:.4f}, top-1 {r.top1_agree:.3f}, kv/fp16 {r.compression:.3f}"
    print(summary)
    assert r.n_scored == N_SCORE
    return r, summary


@pytest.mark.real_model
@pytest.mark.slow
def test_target4_waterfill_meets_the_4bit_class_target():
    r, summary = _waterfill_point(4, TARGET4_CONTEXT)
    assert r.kld <= TARGET4_MAX_KLD, f"4-bit target, KLD half: {summary}"
    assert r.compression <= TARGET4_MAX_BYTES, f"4-bit target, bytes half: {summary}"
    assert r.top1_agree >= TARGET4_MIN_TOP1, f"top-1 regression: {summary} (gate {TARGET4_MIN_TOP1})"


# ------------------------------------------------------------------------------------------------
# 2-bit class (the developers' guide: whole-cache bytes <= 0.15x fp16 with next-token KLD <= 0.05 nats from 1024
# tokens). Waterfill at 2 bits with a 16-row window and fitted key ranges meets both halves at 4096 tokens (at
# 2048 the float16 window and sinks keep the bytes at 0.152x; docs/RESULTS.md "Quality targets"); this test holds
# it there. Measured when set (mlx 0.32.4 CPU, float32 compute): KLD 0.031, kv/fp16 0.144 (before the fitted
# ranges: KLD 0.083).
TARGET2_CONTEXT = 4096
TARGET2_MAX_KLD = 0.05
TARGET2_MAX_BYTES = 0.15


@pytest.mark.real_model
@pytest.mark.slow
def test_target2_waterfill_meets_the_2bit_class_at_4096():
    r, summary = _waterfill_point(2, TARGET2_CONTEXT)
    assert r.kld <= TARGET2_MAX_KLD, f"2-bit class, KLD half: {summary}"
    assert r.compression <= TARGET2_MAX_BYTES, f"2-bit class, bytes half: {summary}"
