# Session 53 (2026-12-07), this project's 2-core x86-64 CPU machine (AMD EPYC, AVX2), SmolLM2-135M's shape, float32.
# kvquant_palu_a2ats_4k_before_after.txt: the whole model at 4k, the tree at the session's start (57f9328, a git
# worktree at /tmp/wt_before) and after KVQuant's and Palu's kernels and A2ATS's step (857a501), alternated, two pairs:
for r in 1 2; do for t in /tmp/wt_before /work/main; do (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python \
  scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method kvquant --method palu --method a2ats); done; done
# cachegen_4k_before_after.txt: CacheGen on KVQuant's kernel, the tree at the session's start and after (7edc5a0), one
# pair:
for t in /tmp/wt_before /work/main; do (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py \
  --context 4096 --steps 8 --rounds 3 --method cachegen); done
# one layer's step at 4k, Palu (its part with and without rebuilding the keys) and A2ATS: ad-hoc timings printed only
# (numbers in docs/RESULTS.md, "KVQuant, CacheGen and Palu on CPU kernels").
# cachegen_4k_uniform.txt: after CacheGen's uniform codes are decoded without a table (d0d623a), one pair again:
for t in /tmp/wt_before /work/main; do (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py \
  --context 4096 --steps 8 --rounds 3 --method cachegen); done
