"""Experiment: prefill with and without the contract's per-chunk finite check (a host sync per layer)."""
import sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veloxquant_mlx import _blas
_blas.preload()
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from veloxquant_mlx.bench import random_model
from veloxquant_mlx.cache import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache.contract import CompressedKVCache
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_host_device import prefill_split

orig = CompressedKVCache._check_input
def no_sync(self, keys, values):
    self._shape = (keys.shape[1], keys.shape[3], values.shape[3])

model = random_model(sys.argv[2] if len(sys.argv) > 2 else "llama-8b")
cfgs = {"kivi": dict(method="kivi", bit_width_inlier=4),
        "waterfill": dict(method="waterfill", bit_width_inlier=4, residual_length=16)}
for T in map(int, sys.argv[1].split(",")):
    prompt = mx.random.randint(0, 1000, (T,))
    for rep in range(2):
        for name in ("plain", "kivi", "waterfill"):
            CompressedKVCache._check_input = no_sync if name.endswith("nocheck") else orig
            base = name.split("-")[0]
            caches = make_prompt_cache(model) if base == "plain" else KVCacheBuilder.for_model(model, KVCacheConfig(**cfgs[base]))
            t0 = time.perf_counter()
            prefill_split(model, prompt, caches, name, False)
            print(f"   total {time.perf_counter() - t0:.3f} s", flush=True)
            del caches
            mx.clear_cache()
