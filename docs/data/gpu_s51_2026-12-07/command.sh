# Session 51 (2026-12-07), one NVIDIA H100 80GB HBM3 (host: "Intel(R) Xeon(R) Processor", 16 cores, pin.txt), MLX
# 0.32.4 CUDA, llama-8b's shape with random weights, tree at 90381f5 unless said. After `cp .gpu/a/* /root/stash/`
# (carry .gpu/a) and `install` (carry .gpu/b, .gpu/c):
CONTEXTS="8192 32768" ROUNDS=4 TMO=250 bash scripts/gpu_run.sh install tripaired    # paired_8192.txt, paired_32768.txt
# ab_32768_{1,2}.txt: the tree at session 50's start (22b86a6, a git worktree carried as oldtree/) and this one,
# alternated, to tell a regression from the machine (both read the same):
for r in 1 2; do for t in oldtree .; do (cd $t && PYTHONPATH=/root/site:$PWD python3 scripts/decode_model_cpu.py \
  --shape llama-8b --context 32768 --steps 32 --rounds 3 --burst --method kivi:bit_width_inlier=4 \
  --method waterfill:bit_width_inlier=4,residual_length=16); done; done
bash scripts/gpu_run.sh - pin    # pin.txt; KIVI-4's bench at 32k pinned to cores 0-7 / 8-15: pin_0-7.json, pin_8-15.json
CONTEXTS="32768 131072" ROUNDS=3 ROUNDS128=2 TMO=260 taskset -c 0-7 bash scripts/gpu_run.sh - tripaired
#   -> paired_32768_pinned_0-7.txt, paired_131072_pinned_0-7.txt
# hdp_32768.txt: a step's host time, build + queue (pipelined steps; the first plain line's KIVI run failed on a flag)
for m in kivi waterfill; do python3 scripts/decode_host_device.py --context 32768 --method $m --bits 4 --pipelined; done
