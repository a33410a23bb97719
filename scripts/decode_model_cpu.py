"""Whole-model decode speed of compressed caches against mlx_lm's plain cache with the prompt's K/V written
straight into the caches (no prefill through the model: minutes saved on a CPU; ``--prefill`` runs one), steps
pipelined as mlx_lm's ``generate_step`` runs them, candidates interleaved over several rounds so machine noise hits
them alike; each round's rate is also read against the plain cache's in the same round (paired ratios). Runs on the
default device (the H200 too: ``--shape llama-8b --context 8192 --rounds 5``).

    python scripts/decode_model_cpu.py --shape smollm2 --context 4096 --steps 24 --rounds 3 --method kivi
    python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 8 --burst --method kivi:bit_width_inlier=4
    python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 2 --prefill --all   # every mlx_lm method

A spec ending ``@FOLDER`` runs that method with the decode kernels of a copy of ``veloxquant_mlx/cache/kernels/`` in
FOLDER (``scripts/decode_kernel_variants.py``'s variants), so two kernel builds are compared in one process, round by
round: ``--method kivi:bit_width_inlier=4 --method kivi:bit_width_inlier=4@kvar/rolled``.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx import bench  # noqa: E402
from veloxquant_mlx.cache import METHOD_NAMES, KVCacheBuilder, method_info  # noqa: E402
from veloxquant_mlx.cache.settings import build_config, parse_sets  # noqa: E402
from veloxquant_mlx.eval.fidelity import prefill  # noqa: E402


def filled(model, make, T: int, chunk: int = 1024, through_model: bool = False):
    """Caches from ``make(model)`` holding T rows per layer: random K/V written chunk by chunk, every layer's chunk
    before the next chunk (the cross-layer caches, xKV and MiniCache, pair layers in that order), or with
    ``through_model`` a random prompt prefilled through the model (the eviction methods score with its queries)."""
    caches = make(model)
    if through_model:
        prompt = mx.random.randint(0, model.args.vocab_size, (1, T))
        prefill(model, prompt, caches, chunk)
        return caches
    args = model.args
    H, D = args.num_key_value_heads, args.hidden_size // args.num_attention_heads
    dt = bench.default_dtype()
    for a in range(0, T, chunk):
        n = min(chunk, T - a)
        for c in caches:
            k = mx.random.normal((1, H, n, D)).astype(dt)
            v = mx.random.normal((1, H, n, D)).astype(dt)
            mx.eval(c.update_and_fetch(k, v))
    return caches


def decode_rate(model, caches, steps: int) -> float:
    def step(tok):
        return mx.argmax(model(tok[:, None], cache=caches)[:, -1, :], axis=-1)
    mx.eval(step(mx.zeros((1,), dtype=mx.int32)))  # warm-up step
    _, times = bench.pipelined_decode(step, mx.zeros((1,), dtype=mx.int32), steps)
    return steps / sum(times)


_KERNEL_USERS = (("veloxquant_mlx.cache.grouped", "kivi_kernel", "kivi"),
                 ("veloxquant_mlx.cache.methods.quantization.kivi_batch", "kivi_kernel", "kivi"),
                 ("veloxquant_mlx.cache.methods.quantization.waterfill", "wf_kernel", "waterfill"),
                 ("veloxquant_mlx.cache.methods.quantization.waterfill_batch", "wf_kernel", "waterfill"),
                 ("veloxquant_mlx.cache.methods.quantization.turboquant_rvq", "tq_kernel", "turboquant_rvq"))


_VARIANTS: dict = {}  # FOLDER -> its kernel modules (decode_kernel_variants.load), loaded once


def use_kernels(spec: str) -> None:
    """Point the caches' decode-kernel modules at the copy named by ``spec``'s ``@FOLDER`` (the package's own
    modules when it has none)."""
    folder = spec.partition("@")[2]
    if folder and folder not in _VARIANTS:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from decode_kernel_variants import load

        _VARIANTS[folder] = load(folder)
    for module, attr, kernel in _KERNEL_USERS:
        own = importlib.import_module(f"veloxquant_mlx.cache.kernels.{kernel}")
        setattr(importlib.import_module(module), attr, _VARIANTS[folder].get(kernel, own) if folder else own)


def cache_makers(specs, plain: bool = True) -> dict:
    """{label: model -> caches}: mlx_lm's plain cache (``plain``) and each ``method[:field=value,...][@FOLDER]``
    spec."""
    makers = {"none": lambda m: make_prompt_cache(m)} if plain else {}
    for spec in specs:
        name, _, sets = spec.partition("@")[0].partition(":")
        cfg = build_config(name, parse_sets([s for s in sets.split(",") if s], name))
        makers[spec] = lambda m, cfg=cfg: KVCacheBuilder.for_model(m, cfg)
    return makers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--method", action="append", default=None, help="method[:field=value,...] (repeatable)")
    ap.add_argument("--burst", action="store_true",
                    help="fill every candidate's caches once, then per round decode --steps from the same context for "
                         "each in turn, trimming the rows back (short interleaved bursts: a shared machine's slow "
                         "spells hit the candidates alike; --steps + 1 must stay below a method's group)")
    ap.add_argument("--prefill", action="store_true",
                    help="fill the caches by prefilling a random prompt through the model (chunks of 1024) instead of "
                         "writing random K/V: what the eviction methods need (they score with the model's queries)")
    ap.add_argument("--all", action="store_true", help="every method speaking mlx_lm's cache protocol, at its defaults")
    a = ap.parse_args(argv)
    model = bench.random_model(a.shape)
    specs = list(a.method or [])
    if a.all:
        specs += [m for m in METHOD_NAMES if method_info(m).protocol == "mlx_lm" and m not in specs]
    makers = cache_makers(specs or ["kivi:bit_width_inlier=4"])
    rates = {k: [] for k in makers}
    held = {}
    if a.burst:
        for name, make in makers.items():
            use_kernels(name)
            held[name] = filled(model, make, a.context, through_model=a.prefill)
    for r in range(a.rounds):
        for name, make in makers.items():
            use_kernels(name)
            caches = held.get(name) or filled(model, make, a.context, through_model=a.prefill)
            rates[name].append(decode_rate(model, caches, a.steps))
            print(f"  .. round {r + 1} {name} {rates[name][-1]:.2f} tok/s", file=sys.stderr, flush=True)
            if a.burst:
                for c in caches:
                    c.trim(a.steps + 1)
                continue
            del caches
            mx.clear_cache()
    base = statistics.median(rates["none"])
    print(f"{a.shape}, context {a.context}, {a.steps} steps x {a.rounds} rounds, device {mx.default_device()}")
    for name, v in rates.items():
        med = statistics.median(v)
        paired = sorted(x / y for x, y in zip(v, rates["none"]))  # each round against the plain cache's same round
        print(f"  {name:40s} {med:7.2f} tok/s [{min(v):.2f}-{max(v):.2f}]  {med / base:5.2f}x  "
              f"(per round: median {statistics.median(paired):.2f}x [{paired[0]:.2f}-{paired[-1]:.2f}])")
        print(f"  {'':40s} rounds: {' '.join(f'{x:.1f}' for x in v)} tok/s")


if __name__ == "__main__":
    main()
