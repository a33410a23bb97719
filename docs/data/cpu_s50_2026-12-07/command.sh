# Session 50 (2026-12-07), this 2-core machine (MLX CPU, float32, SmolLM2's shape with random weights).
# SKVQ's decode on KIVI's CPU kernel (keys as rows): one layer at 8k, then the whole model at 4k, the tree before
# (dc6e25c, a git worktree in /tmp/wt_before) and after alternated, two pairs:
python scripts/decode_step_cpu.py --context 8192 --method skvq   # before 15.4 ms (min 9.1), after 1.9 (min 1.5)
for r in 1 2; do for t in /tmp/wt_before .; do
  OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method skvq \
    > skvq_4096_{before,after}_$r.txt; done; done
# ZipCache on KIVI's CPU kernel (its hi and lo stores, keys as rows): one layer at 8k, then the whole model at 4k
python scripts/decode_step_cpu.py --context 8192 --method zipcache   # before 20.0 ms (min 16.9), after 3.4 (min 3.0)
for t in /tmp/wt_before .; do OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 \
  --rounds 3 --method zipcache > zipcache_4096_{before,after}_1.txt; done
# GEAR on KIVI's CPU kernel, its outliers and low-rank term applied to each decoded block (kivi_decode fixes=):
python scripts/decode_step_cpu.py --context 8192 --method gear   # before 14.8 ms (min 11.0), after 3.1 (min 2.9)
for t in /tmp/wt_before .; do OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 \
  --rounds 3 --method gear > gear_4096_{before,after}_1.txt; done
# alldec_2048_after.txt (at 278ab82, one round: a single plain-cache round is the reference of every ratio):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --shape smollm2 --context 2048 --steps 8 --rounds 1 --prefill --all
# gear_4096_after_2.txt: the low-rank term in the block's products instead of its rows (one layer at 8k 3.1 -> 2.2 ms)
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method gear
