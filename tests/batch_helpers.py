"""Shared by the batch-form tests (tests/test_{kivi,turboquant_rvq,streaming_llm}_batch.py):
prompts for the tiny models, mlx_lm's single-request loop, a driver for mlx_lm's ``BatchGenerator``
that records what each request got, and a tolerance helper."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from numerics import float16_rounding_effect_on_logprobs
from tiny_models import VOCAB


def prompt(n, k):
    return [(i * 37 + 11 + 13 * k) % VOCAB for i in range(n)]


def alone(model, prompt, max_tokens, cache, prefill_step_size=2048):
    """(tokens, logprobs) of mlx_lm's single-request loop, greedy."""
    out = list(generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                             prefill_step_size=prefill_step_size))
    return [int(t) for t, _ in out], [lp for _, lp in out]


class Run:
    """Drives a BatchGenerator; collects tokens, logprobs and the extracted caches per uid."""

    def __init__(self, model, max_tokens=40, **kw):
        self.gen = BatchGenerator(model, max_tokens=max_tokens, **kw)
        self.tokens, self.logprobs, self.final = {}, {}, {}

    def insert(self, prompts, caches, max_tokens=None):
        uids = self.gen.insert(prompts, max_tokens, caches=caches)
        for u in uids:
            self.tokens[u], self.logprobs[u] = [], []
        return uids

    def busy(self):
        return self.gen._unprocessed_sequences or len(self.gen._prompt_batch) or len(self.gen._generation_batch)

    def step(self):
        _, responses = self.gen.next()
        for r in responses:
            self.tokens[r.uid].append(r.token)
            self.logprobs[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                self.final[r.uid] = r.prompt_cache
        return responses

    def run(self):
        while self.busy():
            self.step()
        self.gen.close()


def batch_caches(gen):
    """The batch caches of a BatchGenerator's running and prompt batches."""
    return [c for c in gen._generation_batch.prompt_cache] + [c for c in gen._prompt_batch.prompt_cache]


def frac_off(x, y):
    """Fraction of elements that differ by more than 1% of the array's scale."""
    x, y = x.astype(mx.float32), y.astype(mx.float32)
    return float(mx.mean(mx.abs(x - y) > 1e-2 * mx.abs(y).max() + 1e-3))



def check_against_alone(model, run, uids, prompts, max_tokens, alone_caches, same_state, prefill_step_size=2048,
                        histories=None):
    """Each request of ``run`` got what it gets alone: its greedy tokens, its logprobs and, layer by layer,
    the state ``same_state(extracted, alone)`` accepts. The batch sums in other orders (its widths, masked
    slots), and rows on a float16 rounding edge are then stored an ulp apart: the logprobs may differ by
    what rounding every stored row to float16 moves them on that request's tokens (tests/numerics.py).
    ``histories[i]``: the tokens request i's cache already held before its prompt."""
    for k, (u, p, m, c) in enumerate(zip(uids, prompts, max_tokens, alone_caches)):
        toks, lps = alone(model, p, m, c, prefill_step_size)
        assert len(run.tokens[u]) == m
        diff = max(float(mx.abs(a - b).max()) for a, b in zip(lps, run.logprobs[u]))
        seen = (histories[k] if histories else []) + list(p)
        tol = float16_rounding_effect_on_logprobs(model, seen + toks, len(seen))
        assert diff <= tol, (len(p), diff, tol)
        assert run.tokens[u] == toks, len(p)
        for ext, one in zip(run.final[u], c):
            same_state(ext, one)


def run_with_late_joiners(model, first, first_caches, late, late_caches, first_max, late_max):
    """A batch of ``first`` decodes 8 steps, then ``late`` joins it (extend; caches may hold history);
    runs to the end. Returns (run, uids, the generation batch sizes seen after the join)."""
    run = Run(model)
    uids = run.insert(first, first_caches, first_max)
    for _ in range(8):
        run.step()
    assert len(run.gen._generation_batch) == len(first)
    uids += run.insert(late, late_caches, late_max)
    sizes = set()
    while run.busy():
        run.step()
        sizes.add(len(run.gen._generation_batch))
    return run, uids, sizes


def joiners_with_history_equal_alone(model, make_caches, reused, history, rest, same_state):
    """Two requests decode; then two join the running batch (extend, empty caches next to full ones),
    one of them with ``reused``, a cache already holding the tokens ``history``, whose prompt continues
    with ``rest`` (merge with history). Each request equals its run alone (``check_against_alone``)."""
    import copy

    first = [prompt(70, 0), prompt(33, 1)]
    reused_alone = copy.deepcopy(reused)
    held = reused[0].offset
    late = [rest, prompt(120, 3)]
    run, uids, sizes = run_with_late_joiners(model, first, [make_caches() for _ in first], late,
                                             [reused, make_caches()], [40, 12], [30, 40])
    assert {4, 3} <= sizes  # the late requests joined; the short one left first
    alone_caches = [make_caches(), make_caches(), reused_alone, make_caches()]
    check_against_alone(model, run, uids, first + late, [40, 12, 30, 40], alone_caches, same_state,
                        histories=[[], [], list(history), []])
    assert run.final[uids[2]][0].offset == held + len(rest) + 30  # one step computed ahead, as alone


def attend_steps_equal_singles(batch, singles, steps, H, Hq, D, tol_codes, tol_dense):
    """Random rows for ``steps`` (``(N, lengths or None)``: a right-padded call when lengths are given)
    through a layer of ``batch`` (mask, update, dispatched attention on the codes, and dense attention
    over the rows returned) and through each single cache: each sequence's outputs agree."""
    from veloxquant_mlx.cache import dispatch

    for N, lengths in steps:
        k, v, q = (mx.random.normal((len(singles), H, N, D)), mx.random.normal((len(singles), H, N, D)),
                   mx.random.normal((len(singles), Hq, N, D)))
        if lengths:
            batch.prepare(lengths=lengths, right_padding=[N - n for n in lengths])
        mask = batch.make_mask(N)
        K, V = batch.update_and_fetch(k, v)
        out = dispatch.dispatched_sdpa(q, K, V, cache=batch, scale=0.125, mask=mask)
        dense = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.125, mask=mask)
        if lengths:
            batch.finalize()
        for i, c in enumerate(singles):
            n = lengths[i] if lengths else N
            m = c.make_mask(n)
            Ks, Vs = c.update_and_fetch(k[i:i + 1, :, :n], v[i:i + 1, :, :n])
            ref = c.attend(q[i:i + 1, :, :n], Ks, Vs, scale=0.125, mask=m)
            assert float(mx.abs(ref - out[i:i + 1, :, :n]).max()) < tol_codes
            assert float(mx.abs(ref - dense[i:i + 1, :, :n]).max()) < tol_dense


def real_model_batch_equals_alone(spans, max_tokens, make_caches, same_state, plain_reference=False):
    """The embedded SmolLM2-135M: essay prompts ``ids[a:b]`` for each ``(a, b)`` in ``spans``, decoded
    together by mlx_lm's BatchGenerator with caches from ``make_caches(model)``: each request's greedy
    tokens equal its run alone through mlx_lm.stream_generate, and layer by layer
    ``same_state(extracted, alone, exact=False)`` holds. ``plain_reference``: ``same_state`` also gets
    ``plain=``, that layer's mlx_lm plain cache fed the same tokens (unquantized float32 rows), to bound
    differences by what quantization does to the same rows. Returns the lone runs' caches."""
    import mlx_lm

    from veloxquant_mlx.assets import essays_text
    from veloxquant_mlx.model import load_model

    model, tokenizer = load_model(None)
    ids = tokenizer.encode(essays_text(max_chars=4000), add_special_tokens=False)
    prompts = [ids[a:b] for a, b in spans]
    alone_caches = [make_caches(model) for _ in prompts]
    lone = [[r.token for r in mlx_lm.stream_generate(model, tokenizer, p, max_tokens=max_tokens, prompt_cache=c)]
            for p, c in zip(prompts, alone_caches)]
    run = Run(model, max_tokens=max_tokens, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    uids = run.insert(prompts, [make_caches(model) for _ in prompts])
    run.run()
    for u, toks, c in zip(uids, lone, alone_caches):
        got = run.tokens[u]
        if got and got[-1] in tokenizer.eos_token_ids:  # stream_generate does not yield the stop token
            got = got[:-1]
        assert got == toks
        extra = {}
        if plain_reference:
            plain = make_prompt_cache(model)
            mx.eval(model(mx.array(prompts[uids.index(u)] + toks)[None], cache=plain))
        for k, (ext, one) in enumerate(zip(run.final[u], c)):
            if plain_reference:
                extra = {"plain": plain[k]}
            same_state(ext, one, exact=False, **extra)
    return alone_caches
