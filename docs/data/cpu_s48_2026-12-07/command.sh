# Session 48 (2026-12-07), a 2-core AMD EPYC (Zen 3; AVX2, FMA, F16C, no AVX-512), MLX 0.32.4's CPU backend, OpenBLAS
# preloaded, SmolLM2's shape, random float32 weights. "before" = 7b5560a (a git worktree: TurboQuant-RVQ's CPU decode
# kernel as session 47 left it), "after" = this session's kernel (commits after 7b5560a); runs alternate the trees.
# step_8k_ab.txt: one layer's decode step (store + attention through the dispatch point), 3 KV x 3 query heads, d 64:
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_step_cpu.py --context 8192 --steps 150
# rvq_4k_ab.txt (before, after, before, after) and rvq_16k_ab.txt (before, after): the whole model, caches filled directly
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 4 --burst --method turboquant_rvq
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 3 --burst --method turboquant_rvq
# batch_2k_ab.txt: 4 requests of 1664..2048 tokens, merged, against mlx_lm's BatchKVCache
OPENBLAS_THREAD_TIMEOUT=4 python scripts/batch_decode.py --shape smollm2 --batch 4 --context 2048 --steps 8 --repeats 3 \
  --method turboquant_rvq
# prefill_4k_ab.txt: after (2a9863d, the native softmax in the CPU prefill tiles) then before (c4d4273), each method
# after a first unmeasured run; chunks of 1024. s47's figures for the same command (0.92x / 0.94x / 1.19x) do not
# repeat on this session's machine: s47's own end (8f542b8) gave waterfill 0.48x here today (69.6 s plain, 33.6 s).
OPENBLAS_THREAD_TIMEOUT=4 python scripts/prefill_peak.py --shape smollm2 --contexts 4096 --steps 1024 \
  --methods none,waterfill:bit_width_inlier=4:residual_length=16,kivi:bit_width_inlier=4,turboquant_rvq --warm
