# Session 47 (2026-12-07), a 2-core AMD EPYC (Zen 3: family 25 model 1; AVX2, FMA, F16C, no AVX-512), MLX 0.32.4's
# CPU backend, OpenBLAS preloaded (veloxquant_mlx's import), SmolLM2's shape, random float32 weights.
# "before" = 61f01d1 (session 46's end, a git worktree; the new batch_decode.py copied into it), "batch_kernels" =
# 3c134a2 (the batch forms on the CPU kernels), "after" = 001f47c (+ the kernels in the hardware's vector width).
M="--method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16 --method turboquant_rvq"
# batch_2k_{before,batch_kernels,after}.{txt,json}: 4 requests of 1664..2048 tokens prefilled alone, merged, 8 steps
# x 3 repeats, the methods alternated per repeat
OPENBLAS_THREAD_TIMEOUT=4 python scripts/batch_decode.py --shape smollm2 --batch 4 --context 2048 --steps 8 \
  --repeats 3 $M --out batch_2k_after.json
# decode_model_4k_{before,after}.txt (one sequence, caches filled directly, per-round ratios):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 4 --burst \
  --method turboquant_rvq --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16
# decode_model_16k_after.txt: the same with --context 16384 --rounds 3
# prefill_peak_4k.txt (after): chunks of 1024, each method after a first unmeasured run
OPENBLAS_THREAD_TIMEOUT=4 python scripts/prefill_peak.py --shape smollm2 --contexts 4096 --steps 1024 \
  --methods none,waterfill:bit_width_inlier=4:residual_length=16,kivi:bit_width_inlier=4,turboquant_rvq --warm
