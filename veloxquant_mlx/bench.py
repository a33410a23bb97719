"""Side-by-side speed and memory of KV caches in one process: prefill, decode, resident bytes, peak.

For every context length and repeat, each candidate cache runs once (the order rotates by one each repeat): a
random prompt of ``context`` tokens is prefilled in chunks of 2048 (mlx_lm's default), its greedy next token
evaluated (``prefill_s`` = time to that first token), then ``decode_tokens`` greedy steps run pipelined as
mlx_lm's ``generate_step`` runs them (:func:`pipelined_decode`): ``decode_tps`` counts every step, ``steady_tps``
= one over the median step (``step_s``), the rate of a long generation, and ``first_step_s`` the first step alone.
They differ because some steps are slow -- above all the first after the prompt, where buffers are allocated again
(after ``mx.clear_cache()``, as in mlx_lm's generation) and mlx_lm's plain ``KVCache``, filled exactly by a
power-of-two prompt, copies its whole buffer into a larger one -- and a run of a few decode tokens weighs that step
far above its share of a long generation. Memory, from MLX's allocator: ``kv_resident_bytes`` = active memory
after the run minus before it (what the caches keep alive, slack included), beside ``kv_nbytes`` (the caches' own
``nbytes``); ``peak_bytes`` = ``mx.get_peak_memory()`` (weights included), ``peak_delta_bytes`` = that peak minus
the memory in use before the run; ``kv_fraction_of_fp16`` = median ``kv_nbytes`` / ``kv_bytes_fp16`` (mlx_lm's
plain fp16 cache, no slack).

Each statistic is the median with min and max over the repeats (``samples``: per-repeat prefill, decode and
peak, in run order), also given as a ratio to each baseline measured in the same run: ``none`` (mlx_lm's
``KVCache``), ``mlx_q4`` and ``mlx_q8`` (its ``QuantizedKVCache``, group 64, or 32 for small heads), with a
bound on its spread (``ratio_spread``: both medians' relative half-ranges added). Where the candidates ran
interleaved in one process (not ``--isolate``), ``paired_ratios`` also gives the median, min and max of the
per-repeat ratios (each repeat against the baseline's run of the same repeat, seconds apart): a machine's slow
spell then hits both sides of a ratio alike, where the ratio of medians can pair a fast spell with a slow one
(docs/RESULTS.md). A candidate that raises is reported unavailable (``available: false`` with the error);
``isolate=True`` (CLI ``--isolate``) runs each candidate in its own subprocess, so even a hard crash only loses it.

``batch=N`` (CLI ``--batch N``): N random prompts decoded together through one batch cache per layer (the N
per-request caches merged); ``decode_tps`` is then the total over the N sequences. A candidate without a batch
form (:func:`has_batch_form`: mlx_lm's ``QuantizedKVCache`` has none) is refused.

``decode_s_per_1k`` is the least-squares slope of the median decode-step time against the context length
(seconds per 1000 context tokens, two or more contexts): an O(context) step with a large constant, or
O(context²), shows up as a slope far above ``none``'s. Shapes (:data:`SHAPES`, random weights: speed does not
depend on weight values): ``llama-1b``, ``llama-8b``, ``smollm2`` (the embedded model's) and ``tiny`` (tests).
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.utils
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from . import _blas
from .cache.base import METHOD_NAMES
from .cache.factory import _attention, _head_dim, _layers, language_model
from .eval.fidelity import make_caches, prefill
from .eval.specs import NONE, MethodSpec
from .generate import has_batch_form as method_has_batch_form
from .measure import fp16_kv_bytes, kv_bytes, kv_fraction_of_fp16
from .model import mlx_dtype

__all__ = ["SHAPES", "BASELINES", "STATS", "RATIO_STATS", "random_model", "default_dtype", "Candidate",
           "candidates", "has_batch_form", "batch_methods", "batch_caches", "run_once", "bench", "add_ratios",
           "paired_ratios", "add_slopes", "fit_slope", "stats", "bench_isolated", "pipelined_decode"]

#: Random-weight Llama shapes: mlx_lm ``llama.ModelArgs`` fields.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0),
    "smollm2": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0),
    "llama-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0),
    "llama-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0),
}

#: The reference caches measured with every run: mlx_lm's plain cache and its quantized one.
BASELINES = (NONE, "mlx_q4", "mlx_q8")
_MLX_QUANT_BITS = {"mlx_q4": 4, "mlx_q8": 8}

#: Per-run measurements summarized as median/min/max; the ones also given as ratios.
STATS = ("prefill_s", "decode_tps", "steady_tps", "step_s", "first_step_s", "kv_resident_bytes", "kv_nbytes",
         "peak_bytes", "peak_delta_bytes")
RATIO_STATS = ("prefill_s", "decode_tps", "steady_tps", "kv_resident_bytes", "kv_nbytes", "peak_bytes",
               "peak_delta_bytes")

#: Per-run values also kept as the list over the repeats (``row["samples"]``, in run order).
SAMPLED = ("prefill_s", "decode_tps", "steady_tps", "peak_delta_bytes")

PREFILL_STEP = 2048

#: ``bench(warmup=...)``: no warm-up, one short run per candidate, or one run per candidate and context.
WARMUPS = (False, True, "none", "short", "full")


def default_dtype():
    """float32 on the CPU backend (fast BLAS path), float16 on a GPU."""
    return _blas.compute_dtype()


def random_model(shape: str, dtype=None, seed: int = 0):
    """An mlx_lm Llama of the named :data:`SHAPES` entry with random N(0, 0.02) matrices, in ``dtype``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}")
    dt = mlx_dtype(dtype)
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SHAPES[shape])
    model = llama.Model(args)
    mx.random.seed(seed)
    # The default initializers stay lazy and are never evaluated: each parameter is replaced first.
    params = mlx.utils.tree_map(
        lambda p: (mx.random.normal(p.shape, dtype=dt) * 0.02) if p.ndim > 1 else mx.ones(p.shape, dtype=dt),
        model.parameters())
    model.update(params)
    for layer in model.model.layers:  # materialize layer by layer: bounded peak memory
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    model.eval()
    return model


def _vocab_size(model) -> int:
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(v, int):
        return v
    emb = getattr(getattr(language_model(model), "model", None), "embed_tokens", None)
    return int(emb.weight.shape[0]) if emb is not None else 32000


@dataclass
class Candidate:
    """A cache to benchmark: a name (method or baseline), its settings and a per-run cache factory."""

    name: str
    settings: dict
    make: Callable[[Any], list]

    @property
    def label(self) -> str:
        return MethodSpec(self.name, self.settings).label


def _mlx_quant_factory(bits: int) -> Callable[[Any], list]:
    def make(model):
        group = 64 if _head_dim(_attention(_layers(model)[0]), 64) % 64 == 0 else 32
        return [QuantizedKVCache(group_size=group, bits=bits) if type(c) is KVCache else c
                for c in make_prompt_cache(model)]

    return make


def _check_baseline(b: str) -> str:
    if b not in BASELINES:
        raise ValueError(f"unknown baseline {b!r}; baselines: {', '.join(BASELINES)}")
    return b


def candidates(methods: Sequence, baselines: Sequence[str] = BASELINES) -> list[Candidate]:
    """Baselines first (``none``, ``mlx_q4``, ``mlx_q8``), then ``methods`` (names / specs), deduplicated."""
    out = {b: Candidate(b, {}, _mlx_quant_factory(_MLX_QUANT_BITS[b]) if b in _MLX_QUANT_BITS
                        else lambda model: make_caches(model, None)) for b in map(_check_baseline, baselines)}
    for spec in map(MethodSpec.coerce, methods):
        if spec.label not in out:  # none's config is None: mlx_lm's plain cache
            out[spec.label] = Candidate(spec.method, {} if spec.method == NONE else dict(spec.settings),
                                        lambda model, c=spec.config(): make_caches(model, c))
    return list(out.values())


def has_batch_form(name: str) -> bool:
    """Whether candidate ``name`` decodes batches (:func:`.generate.has_batch_form`; mlx_lm's quantized cache
    has no ``merge``)."""
    return name not in _MLX_QUANT_BITS and method_has_batch_form(name)


def batch_methods() -> list[str]:
    return [m for m in METHOD_NAMES if has_batch_form(m)]


def batch_caches(make: Callable[[Any], list], model, n: int) -> list:
    """One batch cache per layer for ``n`` sequences: ``n`` fresh per-request caches from ``make``, merged."""
    per_request = [make(model) for _ in range(n)]
    return [type(layer[0]).merge(list(layer)) for layer in zip(*per_request)]


def _settle() -> None:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def run_once(model, caches: list, prompt: mx.array, decode_tokens: int,
             prefill_step: int = PREFILL_STEP, on_chunk: Optional[Callable[[int, int], None]] = None) -> dict:
    """Prefill ``prompt`` ([T] ids, or [B, T]: B sequences through batch caches) into ``caches``, decode
    ``decode_tokens`` greedily; the measurements (``decode_tps``: tokens of all B sequences per second) and
    the greedy ``tokens`` (B lists of decode_tokens + 1 ids: the prefill's, then each step's). Decode steps are
    pipelined (:func:`pipelined_decode`; ``step_s``: their median). Memory baselines are taken right before the
    prefill, so ``caches`` should be fresh (empty). ``on_chunk(done, total)`` reports the prefill's chunks."""
    prompt = prompt.reshape(-1, prompt.shape[-1])  # [B, T]
    B, T = prompt.shape
    _settle()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    if T > 1:
        prefill(model, prompt[:, :-1], caches, prefill_step, on_chunk)

    def step(tok):
        return mx.argmax(model(tok[:, None], cache=caches)[:, -1, :], axis=-1)

    tok = step(prompt[:, -1])
    mx.eval(tok)
    prefill_s = time.perf_counter() - t0
    mx.clear_cache()  # as mlx_lm's generate_step after the prompt: decode does not reuse prefill-sized buffers
    out, steps = pipelined_decode(step, tok, decode_tokens)
    tokens = mx.stack([tok] + out, axis=1).tolist()  # held as Python ints: not in the resident figure below
    del tok, out
    mx.eval([c.state for c in caches])
    mx.synchronize()
    resident = mx.get_active_memory() - base
    peak = mx.get_peak_memory()
    decode_s = sum(steps)
    return {
        "prefill_s": prefill_s,
        "decode_tps": (B * len(steps) / decode_s) if decode_s > 0 else None,
        "steady_tps": B / statistics.median(steps) if steps else None,
        "step_s": statistics.median(steps) if steps else None,
        "first_step_s": steps[0] if steps else None,
        "kv_resident_bytes": int(resident),
        "kv_nbytes": kv_bytes(caches),
        "kv_bytes_fp16": fp16_kv_bytes(model, T + len(steps), batch_size=B),
        "peak_bytes": int(peak),
        "peak_delta_bytes": int(peak - base),
        "tokens": tokens,
    }


def pipelined_decode(step: Callable[[mx.array], mx.array], tok: mx.array, n: int) -> tuple[list, list]:
    """``n`` greedy steps from ``tok`` as mlx_lm's ``generate_step`` runs them (step i + 1 built and queued with
    ``mx.async_eval`` while step i evaluates): the tokens and the seconds between successive completions."""
    tokens, steps = [], []
    ts = time.perf_counter()
    if n:
        nxt = step(tok)
        mx.async_eval(nxt)
    for i in range(n):
        tok = nxt
        if i + 1 < n:
            nxt = step(tok)
            mx.async_eval(nxt)
        mx.eval(tok)
        now = time.perf_counter()
        steps.append(now - ts)
        ts = now
        tokens.append(tok)
    return tokens, steps


def stats(values: Sequence[Optional[float]]) -> Optional[dict]:
    """``{"median", "min", "max"}`` of the non-None ``values`` (None if there are none)."""
    vals = [v for v in values if v is not None]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None


def _prompt(vocab: int, n: int, seed: int, batch: int = 1) -> mx.array:
    key = mx.random.key(seed)
    p = mx.random.randint(0, vocab, (batch, n) if batch > 1 else (n,), key=key).astype(mx.int32)
    mx.eval(p)
    return p


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]


def bench(model, methods: Sequence = (), contexts: Sequence[int] = (1024,), repeats: int = 3,
          decode_tokens: int = 32, baselines: Sequence[str] = BASELINES, seed: int = 0,
          prefill_step: int = PREFILL_STEP, warmup=True,
          progress: Optional[Callable[[str], None]] = None, model_name: Optional[str] = None,
          batch: int = 1) -> list[dict]:
    """Rows, one per candidate and context (baselines first), with ratios and slopes filled in; ``batch``
    sequences per run (``batch > 1``: every candidate needs a batch form, else ``ValueError``). ``warmup``
    (:data:`WARMUPS`): untimed runs first, True/"short" one 256-token run per candidate, "full" one per candidate
    and context (a GPU builds attention plans per shape: the first run at a new length is slower)."""
    if repeats < 1 or decode_tokens < 1 or not contexts or min(contexts) < 2 or batch < 1:
        raise ValueError("need repeats >= 1, decode_tokens >= 1, contexts >= 2 and batch >= 1")
    if warmup not in WARMUPS:
        raise ValueError(f"warmup={warmup!r}; allowed: {', '.join(map(repr, WARMUPS))}")
    cands = candidates(methods, baselines)
    refused = [c.label for c in cands if batch > 1 and not has_batch_form(c.name)]
    if refused:
        raise ValueError(f"batch {batch}: no batch form for {', '.join(refused)} (their caches cannot merge "
                         "into one batch cache); drop them, e.g. --baselines none")

    def make(c):
        return c.make(model) if batch == 1 else batch_caches(c.make, model, batch)

    vocab = _vocab_size(model)
    errors: dict[str, str] = {}
    samples: dict[tuple[str, int], list[dict]] = {(c.label, n): [] for c in cands for n in contexts}

    def attempt(c, msg, prompt, n_decode, out=None, on_chunk=None):  # a raise marks the candidate unavailable
        if c.label in errors:
            return
        if progress:
            progress(f"{msg}: {c.label}")
        try:
            r = run_once(model, make(c), prompt, n_decode, prefill_step, on_chunk)
            if out is not None:
                out.append(r)
        except Exception as exc:
            errors[c.label] = _error(exc)
        _settle()
    # First calls compile kernels, build per-shape attention plans and grow the allocator's pool: untimed.
    for n in [] if warmup in (False, "none") else contexts if warmup == "full" else [min(min(contexts), 256)]:
        wp = _prompt(vocab, n, seed + 1, batch)
        for c in cands:
            attempt(c, f"warm-up ({n} tokens)", wp, 2)
    prompts = {n: _prompt(vocab, n, seed + n, batch) for n in contexts}
    for rep in range(repeats):
        order = cands[rep % len(cands):] + cands[: rep % len(cands)]
        for n in contexts:
            for c in order:
                attempt(c, f"repeat {rep + 1}/{repeats}, context {n}", prompts[n], decode_tokens,
                        samples[(c.label, n)], getattr(progress, "chunk", None))
    rows = []
    for c in cands:
        for n in contexts:
            runs = samples[(c.label, n)]
            row = _bench_row(c.name, c.settings, c.label, n, decode_tokens, model_name, batch)
            if c.label in errors:
                row.update(available=False, error=errors[c.label])
            else:
                row.update(repeats=len(runs), **{k: stats([r[k] for r in runs]) for k in STATS})
                row["samples"] = {k: [r[k] for r in runs] for k in SAMPLED}
                if runs:
                    fp16 = runs[0]["kv_bytes_fp16"]
                    row.update(kv_bytes_fp16=fp16, kv_fraction_of_fp16=kv_fraction_of_fp16(
                        _median(row, "kv_nbytes"), fp16))
            row["interleaved"] = True  # the repeats of every candidate ran in turn, in this process
            rows.append(row)
    return add_slopes(add_ratios(rows))


def _bench_row(name, settings, label, context, decode_tokens, model_name, batch: int = 1, **fields) -> dict:
    return {"method": name, "settings": dict(settings), "label": label, "model": model_name, "context": context,
            "batch": batch, "decode_tokens": decode_tokens, "device": str(mx.default_device()), "available": True,
            "error": None, "repeats": 0, **dict.fromkeys(STATS), "kv_bytes_fp16": None, "kv_fraction_of_fp16": None,
            "ratios": {}, "paired_ratios": {}, "decode_s_per_1k": None, "slope_vs_none": None, "interleaved": False,
            **fields}


def _median(row, key) -> Optional[float]:
    s = row.get(key)
    return s["median"] if isinstance(s, dict) else None


def _spread(row, key) -> Optional[float]:
    """Half the min-max range of ``row[key]`` over the repeats, as a fraction of its median."""
    s = row.get(key)
    return (s["max"] - s["min"]) / 2 / abs(s["median"]) if isinstance(s, dict) and s["median"] else None


def paired_ratios(row: dict, ref: dict) -> dict:
    """``{stat: stats of row's sample / ref's sample, repeat by repeat}`` for the :data:`SAMPLED` stats, where
    both rows ran interleaved in one process (``row["interleaved"]``) with the same number of samples; else {}."""
    if not (row.get("interleaved") and ref.get("interleaved")):
        return {}
    a, z = row.get("samples") or {}, ref.get("samples") or {}
    out = {}
    for k in SAMPLED:
        xs, ys = a.get(k) or [], z.get(k) or []
        if xs and len(xs) == len(ys):
            out[k] = stats([x / y if (x is not None and y) else None for x, y in zip(xs, ys)])
    return out


def add_ratios(rows: list[dict], baselines: Sequence[str] = BASELINES) -> list[dict]:
    """``row["ratios"][baseline][stat]`` = row's median / the baseline's median at the same context
    (None where either is missing or the baseline's is 0) and ``row["ratio_spread"][baseline][stat]`` its
    spread: the two medians' spreads (:func:`_spread`) added, a bound on the ratio's relative half-range;
    ``row["paired_ratios"][baseline]`` the per-repeat ratios' stats (:func:`paired_ratios`); rows are modified in
    place and returned."""
    base = {(r["method"], r["context"]): r for r in rows
            if r["method"] in baselines and not r["settings"] and r["available"]}
    for r in rows:
        r["ratios"], r["ratio_spread"], r["paired_ratios"] = {}, {}, {}
        for b in baselines:
            ref = base.get((b, r["context"]))
            if ref is None:
                r["ratios"][b] = r["ratio_spread"][b] = r["paired_ratios"][b] = None
                continue
            r["paired_ratios"][b] = paired_ratios(r, ref) or None
            ratios, spreads = {}, {}
            for k in RATIO_STATS:
                a, z = _median(r, k), _median(ref, k)
                ratios[k] = (a / z) if (a is not None and z) else None
                sa, sz = _spread(r, k), _spread(ref, k)
                spreads[k] = sa + sz if ratios[k] is not None and None not in (sa, sz) else None
            r["ratios"][b], r["ratio_spread"][b] = ratios, spreads
    return rows


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope dy/dx (None with fewer than two distinct x)."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if y is not None]
    return statistics.linear_regression(*zip(*pts)).slope if len({x for x, _ in pts}) >= 2 else None


def add_slopes(rows: list[dict]) -> list[dict]:
    """``decode_s_per_1k``: slope of the median decode-step time vs context (the step at context n sees
    n + decode_tokens/2 tokens on average), per candidate; ``slope_vs_none`` its ratio to ``none``'s."""
    slopes = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        ok = [r for r in rows if r["label"] == label and r["available"]]
        s = fit_slope([r["context"] + r["decode_tokens"] / 2 for r in ok], [_median(r, "step_s") for r in ok])
        slopes[label] = None if s is None else s * 1000.0
    ref = slopes.get(NONE)
    for r in rows:
        s = r["decode_s_per_1k"] = slopes.get(r["label"])
        r["slope_vs_none"] = (s / ref) if (s is not None and ref and ref > 0) else None
    return rows


def bench_isolated(child_args: Callable[[str, Optional[MethodSpec]], list[str]], names: Sequence,
                   contexts: Sequence[int], decode_tokens: int, baselines: Sequence[str] = BASELINES,
                   timeout_s: Optional[float] = None, progress: Optional[Callable[[str], None]] = None,
                   model_name: Optional[str] = None, batch: int = 1) -> list[dict]:
    """Each candidate in its own ``python -m veloxquant_mlx bench ... --json`` subprocess, whose CLI arguments are
    ``child_args(baseline_or_None, spec_or_None)``. A child that fails, crashes or times out makes its rows
    unavailable with the reason; the others are unaffected."""
    jobs = [(b, {}, child_args(b, None)) for b in map(_check_baseline, dict.fromkeys(baselines))]
    jobs += [(s.method, dict(s.settings), child_args(None, s)) for s in map(MethodSpec.coerce, names)
             if not (s.method == NONE and NONE in baselines)]
    rows: list[dict] = []
    for i, (name, settings, argv) in enumerate(jobs, 1):
        label = MethodSpec(name, settings).label
        if progress:
            progress(f"[{i}/{len(jobs)}] subprocess: {label}")
        cmd = [sys.executable, "-m", "veloxquant_mlx", "bench", *argv, "--json"]
        error = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
            if proc.returncode == 0:
                rows += [dict(r, label=label, interleaved=False)  # its process ran apart from the baselines'
                         for r in json.loads(proc.stdout) if r["method"] == name]
                continue
            tail = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
            error = f"subprocess exit code {proc.returncode}" + (f": {tail[-1][:300]}" if tail else "")
        except subprocess.TimeoutExpired:
            error = f"subprocess timed out after {timeout_s:.0f} s"
        except ValueError as exc:  # bad JSON
            error = f"subprocess output unreadable: {exc}"
        rows += [_bench_row(name, settings, label, n, decode_tokens, model_name, batch, available=False, error=error)
                 for n in contexts]
    return add_slopes(add_ratios(rows))
