"""Whole-model prefill of the plain cache, KIVI-4, waterfill-4 (window 16) and TurboQuant-RVQ (defaults) at several
contexts, each chunk split into host time (building the model call's graph) and evaluation, two passes (the second
warm).

    python scripts/prefill_host_device.py --context 8192,32768

A host sync inside a cache's ``update_and_fetch`` shows here as evaluation moving into the host build: the
host waits for the device at every layer. (docs/data/h200_prefill_s11_2026-12-02/
prefill_host_device_with_and_without_check.txt: the library at effba6b, whose NaN check synced per layer, run
by this script's first form, ``scripts/_probe_sync.py`` in commit dc06217, whose ``-nocheck`` rows patch
``CompressedKVCache._check_input`` out.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from veloxquant_mlx import _blas  # noqa: E402

_blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from decode_host_device import prefill_split  # noqa: E402
from veloxquant_mlx.bench import random_model  # noqa: E402
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache.options import KIVIOptions, WaterfillOptions  # noqa: E402

CONFIGS = {"kivi": KVCacheConfig(method="kivi", bit_width_inlier=4, options=KIVIOptions()),
           "waterfill": KVCacheConfig(method="waterfill", bit_width_inlier=4,
                                      options=WaterfillOptions(residual_length=16)),
           "turboquant_rvq": KVCacheConfig(method="turboquant_rvq")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--context", default="8192,32768", help="comma-separated prompt lengths")
    ap.add_argument("--method", action="append", choices=sorted(CONFIGS), help="compressed caches (default: all)")
    ap.add_argument("--profile", action="store_true", help="cProfile the second pass's host build")
    a = ap.parse_args(argv)
    model = random_model(a.shape)
    for T in map(int, a.context.split(",")):
        prompt = mx.random.randint(0, 1000, (T,))
        for rep in range(2):
            for name in ("plain", *(a.method or CONFIGS)):
                caches = make_prompt_cache(model) if name == "plain" else KVCacheBuilder.for_model(model, CONFIGS[name])
                t0 = time.perf_counter()
                prefill_split(model, prompt, caches, name, a.profile and rep == 1)
                print(f"   total {time.perf_counter() - t0:.3f} s", flush=True)
                del caches
                mx.clear_cache()


if __name__ == "__main__":
    main()
