"""Where a model's decode step goes: host time building the step's graph (the model call) against the
time its evaluation then takes (and the host's part of that: queueing the kernels, ``mx.async_eval``), per
step, for a compressed cache and for mlx_lm's plain cache; with ``--profile`` the host side's top Python
functions (cProfile) for the compressed cache. ``--prefill``: the same split for each 2048-token prefill chunk
(summed over the chunks; the second pass is the warm one). ``--pipelined``: steps as the bench runs them.

    python scripts/decode_host_device.py --shape llama-8b --context 8192 --method kivi
    python scripts/decode_host_device.py --context 32768 --method waterfill --set residual_length=16 --prefill
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx.bench import random_model  # noqa: E402
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.eval.fidelity import prefill  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--method", default="kivi")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config field (int)")
    ap.add_argument("--prefill", action="store_true", help="split the prefill's chunks instead of decode steps")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pipelined", action="store_true",
                    help="steps as the bench runs them (step i + 1 built and queued while step i evaluates)")
    ap.add_argument("--stub-kernels", action="store_true",
                    help="any machine: the decode kernels' Python path with a stand-in for MLX's kernel call, and the "
                         "model's layers and heads with small matrices (host build time only; outputs meaningless)")
    ap.add_argument("--pragma", action="append", default=[], metavar="OLD=>NEW",
                    help="rewrite the kernels' sources before compiling (e.g. 'unroll 8=>unroll 2': smaller cubins)")
    a = ap.parse_args(argv)
    rewrite_sources(a.pragma)
    fields = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    model = stub_kernels(a.shape) if a.stub_kernels else random_model(a.shape)
    prompt = mx.random.randint(0, 1000, (a.context,))
    for name in ("plain", a.method, "plain", a.method):
        caches = make_prompt_cache(model) if name == "plain" else KVCacheBuilder.for_model(
            model, KVCacheConfig(method=name, bit_width_inlier=a.bits, **fields))
        if a.prefill:
            prefill_split(model, prompt, caches, name, a.profile and name != "plain")
            del caches
            mx.clear_cache()
            continue
        prefill(model, prompt[:-1], caches, 2048, None)
        if a.pipelined:
            pipelined_split(model, caches, name, a.context, a.steps)
            if name != "plain":
                print_cubins()
            del caches
            mx.clear_cache()
            continue
        tok = mx.array([[1]])
        build, queue, run = [], [], []
        prof = cProfile.Profile() if a.profile and name != "plain" else None
        for i in range(a.steps):
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            logits = model(tok, cache=caches)
            nxt = mx.argmax(logits[:, -1, :], axis=-1)
            if prof:
                prof.disable()
            t1 = time.perf_counter()
            mx.async_eval(nxt)  # returns once the step's kernels are queued: the host's share of the evaluation
            t2 = time.perf_counter()
            mx.eval(nxt)
            t3 = time.perf_counter()
            tok = nxt[:, None]
            if i >= 4:
                build.append(t1 - t0), queue.append(t2 - t1), run.append(t3 - t1)
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        print(f"{name:10s} T={a.context}: host build {med(build):6.2f} ms, eval {med(run):6.2f} ms per step, of which "
              f"queueing the kernels {med(queue):6.2f} ms (medians)", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            pstats.Stats(prof).sort_stats("cumulative").print_stats("veloxquant", 30)
        del caches
        mx.clear_cache()


def rewrite_sources(pairs):
    """Apply each ``OLD=>NEW`` text replacement to every kernel variant's CUDA source before it is compiled."""
    from veloxquant_mlx.cache.kernels import _compile

    if not pairs:
        return
    subs = [p.split("=>", 1) for p in pairs]
    source = _compile.Kernel.source

    def rewritten(self, dtypes, out_dtypes, consts):
        symbol, text = source(self, dtypes, out_dtypes, consts)
        for old, new in subs:
            text = text.replace(f"#pragma {old}\n", f"#pragma {new}\n")
        return symbol, text

    _compile.Kernel.source = rewritten


def print_cubins():
    """The bytes of every kernel variant compiled so far."""
    import gc

    from veloxquant_mlx.cache.kernels import _compile

    for k in (o for o in gc.get_objects() if isinstance(o, _compile.Kernel)):
        for built in k._built.values():
            print(f"  cubin {built[0][:40]:40s} {len(built[1]) / 1e3:7.1f} KB", flush=True)


def stub_kernels(shape):
    """Switch the kernel path on with ``Kernel.__call__`` returning zeros (no compile, no launch), and return the
    ``shape``'s model with its layer and head counts but small hidden, MLP and vocabulary sizes."""
    from veloxquant_mlx import bench
    from veloxquant_mlx.cache import kernels
    from veloxquant_mlx.cache.kernels import _common, _compile

    kernels.kernels_enabled = _common.kernels_enabled = lambda: True
    _common._checked.update(("kivi", "waterfill", "kivi_rows", "waterfill_rows", "waterfill_encode", "kivi_batch",
                            "waterfill_batch", "turboquant_rvq", "turboquant_rvq_encode", "turboquant_rvq_rows"))
    _compile.Kernel.__call__ = lambda self, arrays, scalars, consts, shapes, dtypes, **kw: [
        mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
    bench.SHAPES["stub"] = dict(bench.SHAPES[shape], hidden_size=256, intermediate_size=512, vocab_size=1024)
    return random_model("stub")


def pipelined_split(model, caches, name, context, steps):
    """Per step of a pipelined decode (as ``bench.pipelined_decode``): the host's build of step i + 1, its queueing
    (``mx.async_eval``; long if the host waits there for the device) and the wait for step i; medians."""
    tok = mx.array([1])
    step = lambda t: mx.argmax(model(t[:, None], cache=caches)[:, -1, :], axis=-1)  # noqa: E731
    nxt = step(tok)
    mx.async_eval(nxt)
    build, queue, wait, total = [], [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        cur, nxt = nxt, step(nxt)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        mx.eval(cur)
        t3 = time.perf_counter()
        if i >= 4:
            build.append(t1 - t0), queue.append(t2 - t1), wait.append(t3 - t2), total.append(t3 - t0)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    print(f"{name:10s} T={context} pipelined: build {med(build):5.2f} ms + queue {med(queue):5.2f} ms + wait for the "
          f"previous step {med(wait):5.2f} ms = step {med(total):5.2f} ms (medians)", flush=True)
    mx.eval(nxt)


def prefill_split(model, prompt, caches, name, profile, step=2048):
    """Host build and evaluation time of each prefill chunk (mlx_lm's loop: model call, eval of the states)."""
    build, run = [], []
    prof = cProfile.Profile() if profile else None
    mx.synchronize()
    for start in range(0, prompt.shape[0], step):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        model(prompt[None, start:start + step], cache=caches)
        states = [c.state for c in caches]
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        mx.eval(states)
        t2 = time.perf_counter()
        build.append(t1 - t0), run.append(t2 - t1)
    print(f"{name:10s} prefill T={prompt.shape[0]}: host build {sum(build) * 1e3:7.1f} ms, eval {sum(run) * 1e3:7.1f} ms "
          f"({len(build)} chunks; last chunk {build[-1] * 1e3:.1f} + {run[-1] * 1e3:.1f} ms)", flush=True)
    print("    chunks (build + eval, ms): " + ", ".join(f"{b * 1e3:.1f} + {r * 1e3:.1f}" for b, r in zip(build, run)))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
