"""Each layer of a prefill chunk run alone and synchronously, plain cache against a compressed one: where a chunk's
extra time sits (which chunk, which layer, host build or evaluation). Fresh caches each pass; the first pass warms
the kernels. ``--profile C``: cProfile (cumulative) of the compressed cache's chunk C in the last pass.

    python scripts/prefill_layer_split.py --shape llama-8b --context 8192 --method waterfill --set residual_length=16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.base import create_attention_mask  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from veloxquant_mlx.bench import random_model  # noqa: E402
from veloxquant_mlx.cache import KVCacheBuilder  # noqa: E402
from veloxquant_mlx.cache.settings import build_config, parse_sets  # noqa: E402


def chunk_layers(model, tokens, caches, prof=None):
    """(build s, eval s) per layer of one chunk, each layer evaluated before the next is built."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    mx.eval(h)
    mask = create_attention_mask(h, caches[0])
    out = []
    for layer, c in zip(inner.layers, caches):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        h = layer(h, mask, cache=c)
        st = c.state
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        mx.eval(h, st)
        out.append((t1 - t0, time.perf_counter() - t1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--method", default="waterfill")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--profile", type=int, default=None, metavar="C")
    a = ap.parse_args(argv)
    model = random_model(a.shape)
    cfg = build_config(a.method, parse_sets(a.set, a.method))
    prompt = mx.random.randint(0, 1000, (a.context,))
    for p in range(a.passes):
        for name in ("plain", a.method):
            caches = make_prompt_cache(model) if name == "plain" else KVCacheBuilder.for_model(model, cfg)
            rows = []
            for i, s in enumerate(range(0, a.context, a.chunk)):
                prof = cProfile.Profile() if name != "plain" and p == a.passes - 1 and i == a.profile else None
                per = chunk_layers(model, prompt[s:s + a.chunk][None], caches, prof)
                b, e = sum(x for x, _ in per), sum(y for _, y in per)
                worst = max(range(len(per)), key=lambda j: sum(per[j]))
                rows.append(f"{b * 1e3:.1f}+{e * 1e3:.1f} (layer {worst}: {sum(per[worst]) * 1e3:.1f})")
                if prof:
                    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
            print(f"pass {p} {name:10s} chunks build+eval ms: " + ", ".join(rows), flush=True)
            del caches
            mx.clear_cache()


if __name__ == "__main__":
    main()
