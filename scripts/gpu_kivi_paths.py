"""Decode speed of KIVI's attention paths vs mlx_lm's plain cache on one random-weight shape.

Usage: python scripts/gpu_kivi_paths.py [shape] [context ...]   (run on the GPU machine; see docs/RESULTS.md)
"""

import statistics
import sys

import veloxquant_mlx  # noqa: F401  (BLAS preload on Linux)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.bench import random_model, run_once
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache.methods.quantization.kivi import KIVIKVCache

shape = sys.argv[1] if len(sys.argv) > 1 else "llama-8b"
contexts = [int(c) for c in sys.argv[2:]] or [8192, 32768]
model = random_model(shape)
vocab = model.args.vocab_size
for ctx in contexts:
    prompt = mx.random.randint(0, vocab, (ctx,))
    res = {}
    for rep in range(3):
        for name in ("none", "auto", "sdpa", "dequant", "quantized_matmul"):
            if name == "none":
                caches = make_prompt_cache(model)
            else:
                KIVIKVCache.attend_path = name
                caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=4))
            r = run_once(model, caches, prompt, 32)
            res.setdefault(name, []).append(r["decode_tps"])
            del caches
    base = statistics.median(res["none"])
    for name, v in res.items():
        m = statistics.median(v)
        print(f"{shape} ctx={ctx} {name:8s} decode {m:7.1f} tok/s  [{min(v):.1f}-{max(v):.1f}]  {m / base:.2f}x none", flush=True)
KIVIKVCache.attend_path = "auto"
