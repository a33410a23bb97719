# Session 51 (2026-12-07), this 2-core machine (MLX CPU, float32, SmolLM2's shape with random weights).
# NSNQuant's decode on TurboQuant-RVQ's CPU kernel: one layer at 8k, then the whole model at 4k, the tree before
# (11c1e25, a git worktree in /tmp/wt_before) and after alternated, two pairs:
python scripts/decode_step_cpu.py --context 8192 --method nsnquant   # before 23.8 ms (min 17.8), after 2.7 (min 1.9)
for r in 1 2; do for t in /tmp/wt_before .; do
  OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 \
    --method nsnquant > nsnquant_4096_{before,after}_$r.txt; done; done
