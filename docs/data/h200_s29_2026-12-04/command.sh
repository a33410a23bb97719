# H200 runs of session 29 (after `mkdir -p /root/stash && cp .gpu/a/* /root/stash/` with .gpu/a carried; then
# .gpu/b and .gpu/c carried for `install`). MLX-CUDA 0.32.4, llama-8b shape, random weights, at commit d0573d4.
CONTEXTS=8192,32768 REPEATS=3 EXTRA="--method turboquant_rvq" bash scripts/gpu_run.sh install steadyp
#   -> h200_bench_paired_8k_32k.json
CONTEXTS=131072 REPEATS=2 EXTRA="--method turboquant_rvq" bash scripts/gpu_run.sh - steadyp
#   -> h200_bench_paired_128k.json
# The plot: python scripts/plot_decode.py docs/data/h200_s29_2026-12-04/h200_bench_paired_*.json \
#   --out docs/speed_decode_h200.png
