"""One rank of tests/test_distributed.py (run by ``mlx.launch``; not collected by pytest).

Each rank builds the same tiny random-weight llama twice: unsharded (what one process computes) and
sharded across the launched group with mlx_lm's ``model.shard``. For each method it runs the prompt
and then greedy decoding with caches from ``KVCacheBuilder.for_model`` on the unsharded model, and the
same token sequence (teacher-forced) on the sharded one, and writes per-step logits, argmaxes and the
caches' ``nbytes`` to ``OUT/rank<r>.npz``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import tiny_llama  # noqa: E402
from veloxquant_mlx.cache import options as opt  # noqa: E402
from veloxquant_mlx.cache.config import KVCacheConfig  # noqa: E402
from veloxquant_mlx.cache.factory import KVCacheBuilder  # noqa: E402
from veloxquant_mlx.distributed import init_group, kv_heads, shard_model  # noqa: E402

PROMPT, STEPS = 64, 10
CONFIGS = {
    "kivi": lambda: KVCacheConfig(method="kivi", bit_width_inlier=4, residual_length=16,
                                  options=opt.KIVIOptions(group_size=16)),
    "waterfill": lambda: KVCacheConfig(method="waterfill", bit_width_inlier=4, n_calib_tokens=32,
                                       options=opt.WaterfillOptions(residual_length=16)),
    "snapkv": lambda: KVCacheConfig(method="snapkv", options=opt.SnapKVOptions(budget=32, obs_window=8)),
}


def run(model, config, tokens):
    """Prefill ``tokens[:PROMPT]``, then feed ``tokens[PROMPT:]`` one at a time (teacher forcing), with caches for
    ``config`` (None: mlx_lm's plain caches). Returns (logits [STEPS + 1, vocab] float32 numpy, argmaxes, total
    cache nbytes, constant bytes)."""
    caches = make_prompt_cache(model) if config is None else KVCacheBuilder.for_model(model, config)
    out = [model(mx.array(tokens[None, :PROMPT]), cache=caches)[0, -1]]
    for t in tokens[PROMPT:]:
        out.append(model(mx.array([[int(t)]]), cache=caches)[0, -1])
    logits = np.array(mx.stack(out).astype(mx.float32))
    return logits, logits.argmax(-1), sum(c.nbytes for c in caches), constant_nbytes(caches)


def constant_nbytes(caches) -> int:
    """Bytes the caches hold whatever the head count: waterfill's value rotation (per model, for a value dim
    that is not a power of two), its RoPE angle table (per layer, once used) and its CPU kernel's RoPE tables and
    codebook polynomial (per layer, once a decode step took the kernel: ``_cpu_constants``' last four)."""
    n = sum(c.constant_nbytes for c in caches if getattr(c, "counts_constants", False))
    n += sum(c._omega_cache.nbytes for c in caches if getattr(c, "_omega_cache", None) is not None)
    for c in caches:
        kc = c.__dict__.get("_cpuconst")
        if kc is not None and kc[0] is c.k_lo:
            n += sum(a.nbytes for a in kc[-4:])
    return int(n)


def main(out_dir: str) -> None:
    group = init_group(backend="ring", strict=True)
    rank = group.rank()
    full = tiny_llama(seed=0, n_layers=2)
    sharded = shard_model(tiny_llama(seed=0, n_layers=2), group)
    rng = np.random.default_rng(0)
    result = {"size": group.size(), "kv_heads_full": kv_heads(full), "kv_heads_rank": kv_heads(sharded)}
    arrays = {}
    for name, make in CONFIGS.items():
        prompt = rng.integers(0, 128, PROMPT)
        # the single-process greedy run decides the tokens
        tokens = prompt
        caches = KVCacheBuilder.for_model(full, make())
        step = full(mx.array(prompt[None]), cache=caches)[0, -1]
        ref = [step]
        for _ in range(STEPS):
            nxt = int(mx.argmax(step).item())
            tokens = np.append(tokens, nxt)
            step = full(mx.array([[nxt]]), cache=caches)[0, -1]
            ref.append(step)
        ref_logits = np.array(mx.stack(ref).astype(mx.float32))
        ref_bytes = sum(c.nbytes for c in caches)
        ref_const = constant_nbytes(caches)
        logits, argmax, rank_bytes, rank_const = run(sharded, make(), tokens)
        arrays[f"{name}_tokens"] = tokens
        arrays[f"{name}_ref_logits"] = ref_logits
        arrays[f"{name}_logits"] = logits
        arrays[f"{name}_plain_logits"] = run(full, None, tokens)[0]  # the same tokens, nothing compressed
        arrays[f"{name}_argmax"] = argmax
        result[name] = {"ref_nbytes": int(ref_bytes), "rank_nbytes": int(rank_bytes),
                        "ref_constant_nbytes": ref_const, "rank_constant_nbytes": rank_const}
    # every rank's nbytes, gathered through MLX's engine (the test compares them)
    per_rank = mx.distributed.all_gather(mx.array([[result[n]["rank_nbytes"] for n in CONFIGS]]), group=group)
    result["all_rank_nbytes"] = np.array(per_rank).tolist()
    np.savez(Path(out_dir) / f"rank{rank}.npz", **arrays)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
