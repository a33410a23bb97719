# Session 49 (2026-12-07), this 2-core x86-64 machine, MLX 0.32.4's CPU backend, OpenBLAS preloaded, SmolLM2's shape,
# random float32 weights. Worktrees: 93b3a5a (session 48's end), 08f7f48 (kivi_sink and age_tiered on KIVI's CPU
# kernel, before the vectorized 2- and 8-bit value rows); after = 84062b4.
# alldec_2048_before.txt (at 93b3a5a, one round; some eviction rows ran beside a short test run: read them low):
python scripts/decode_model_cpu.py --shape smollm2 --context 2048 --steps 8 --rounds 1 --prefill --all
# ks_4k_{before,after}.txt (93b3a5a, then 582513d: the CPU route), at_4k_{before,after}.txt (93b3a5a, then 08f7f48):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method kivi_sink \
  --method kivi:bit_width_inlier=2
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method age_tiered
# vals_4k_{before,after}_{1,2}.txt: 08f7f48 then 84062b4, twice, alternating
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method kivi \
  --method kivi_sink --method age_tiered --method kivi:bit_width_inlier=8
# evict_2048.txt (84062b4):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --shape smollm2 --context 2048 --steps 8 --rounds 2 \
  --prefill --method snapkv --method streaming_llm --method h2o --method tova --method morphkv --method rocketkv \
  --method squeeze
# waterfill_kernel_8k_ab.txt: waterfill's CPU kernel alone (its _cpu_part over 8172 quantized rows, one layer, 3 KV x 3
# query heads, d 64, median of 200 calls) at 1dcf4cf (a worktree) and 6d7e199, alternated three times; a throwaway
# script timing `c._cpu_part(q, c.n_quant)` after an 8192-row prefill in chunks of 1024 (not kept)
# wf_4k_{before,after}.txt: 1dcf4cf, then 6d7e199
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method waterfill \
  --method waterfill:bit_width_inlier=8,residual_length=16
# kitty_4k_{before,after}.txt: 8652c7f (a worktree: Kitty's op path), then 3f0196c
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method kitty
# Kitty's one-layer step at 8k, kernels on and off (VELOXQUANT_CPU_KERNELS=1 / 0):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_step_cpu.py --context 8192 --steps 100 --method kitty --method kivi
