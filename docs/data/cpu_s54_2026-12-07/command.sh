# Session 54, this 2-core CPU (SmolLM2 shape, float32): VecInfer's decode at 4k before (30d74b0) and after (75e52da)
# its steps took TurboQuant-RVQ's CPU kernel, alternated twice; output in vecinfer_4k.txt.
git worktree add -q /tmp/wt_before 30d74b0
for i in 1 2; do
for t in /tmp/wt_before .; do
  (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 \
     --method vecinfer 2>&1 | grep -v Warn)
done; done
