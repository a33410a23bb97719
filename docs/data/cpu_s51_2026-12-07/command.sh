# Session 51 (2026-12-07), this 2-core machine (MLX CPU, float32, SmolLM2's shape with random weights).
# NSNQuant's decode on TurboQuant-RVQ's CPU kernel: one layer at 8k, then the whole model at 4k, the tree before
# (11c1e25, a git worktree in /tmp/wt_before) and after alternated, two pairs:
python scripts/decode_step_cpu.py --context 8192 --method nsnquant   # before 23.8 ms (min 17.8), after 2.7 (min 1.9)
for r in 1 2; do for t in /tmp/wt_before .; do
  OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 \
    --method nsnquant > nsnquant_4096_{before,after}_$r.txt; done; done
# SVDq and KVTC on the latent kernel (native/latent_cpu.cpp), xKV on it in KIVI's key layout: one layer at 8k,
# before (the worktree) and after:
python scripts/decode_step_cpu.py --context 8192 --method svdq --method kvtc --method xkv
#   before: svdq 9.4 ms (min 7.3), kvtc 10.6 (min 7.1), xkv 10.7 (min 8.7); plain 3.5
#   after:  svdq 1.6 ms (min 1.5), kvtc 2.8 (min 2.7) (plain 3.4-4.3); xkv 2.7 (min 2.6) (plain 4.6)
# whole model at 4k, before and after alternated (lowrank_*: svdq + kvtc, two pairs; lowrank_4096_after_2.txt rerun
# alone: the first run shared the machine with a test; xkv_*: two pairs, before the value columns were padded):
for r in 1 2; do for t in /tmp/wt_before .; do
  OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 \
    --method svdq --method kvtc > lowrank_4096_{before,after}_$r.txt
  OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 \
    --method xkv > xkv_4096_{before,after}_$r.txt; done; done
# padded_4096_{before,after}.txt: the value columns padded to whole passes of weighted_sum (xKV's 59 value latents
# had fallen to its scalar remainder: its layer at 4k 1.8 -> 1.2 ms of evaluation), all three in one run each:
for t in /tmp/wt_before .; do OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py --context 4096 \
  --steps 8 --rounds 3 --method xkv --method kvtc --method svdq > padded_4096_{before,after}.txt; done
# AMC on the latent kernel (keys as rows on their group's channel ranges: k_rows_per_group; a call per tier):
python scripts/decode_step_cpu.py --context 8192 --method amc   # before 12.6 ms (min 11.4), after 3.3 (min 3.0)
for r in 1 2; do for t in /tmp/wt_before .; do OPENBLAS_THREAD_TIMEOUT=4 python $t/scripts/decode_model_cpu.py \
  --context 4096 --steps 8 --rounds 3 --method amc > amc_4096_{before,after}_$r.txt; done; done
# (the "after" runs were taken at the commit before the ranges' division was moved to once a group, which changed the
# layer's step within its noise: min 3.0 -> 2.95 ms)
# alldec_2048_after.txt (at 6bf14e0, one round: its single plain-cache round is every ratio's reference, and this
# machine was noisy this session -- read it as a ranking; GEAR read 0.90x here against 1.39x in session 50's list):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --shape smollm2 --context 2048 --steps 8 --rounds 1 --prefill --all
