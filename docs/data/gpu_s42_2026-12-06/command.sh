# Session 42 (2026-12-06), one NVIDIA H100 80GB HBM3 (ncu_128k_h200.txt: an H200 earlier the same session).
# Device time by kernel (timeline_*.txt): one cache per process, 2 pipelined steps under Nsight Compute
#   METHODS="none kivi:bit_width_inlier=4 waterfill:bit_width_inlier=4,residual_length=16" CONTEXTS=131072 \
#     bash scripts/gpu_run.sh - timeline
#   (per cache: ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
#      python3 scripts/decode_timeline.py --context 131072 --steps 2 [--method M] > x.csv;
#    python3 scripts/decode_timeline.py --ncu-csv x.csv --steps 2)
# ncu_128k_h200.txt (H200): NCU=1 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
#   --section MemoryWorkloadAnalysis -k regex:decode python3 scripts/decode_kernel_variants.py --context 131072 \
#   --extra 0 veloxquant_mlx/cache/kernels
# Paired rounds (paired_8k_128k.txt, paired_32k_128k_tq.txt):
W="waterfill:bit_width_inlier=4,residual_length=16"
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 --burst --method kivi:bit_width_inlier=4 --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 8192 --steps 32 --rounds 5 --burst --method kivi:bit_width_inlier=4 --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 32768 --steps 32 --rounds 4 --burst --method kivi:bit_width_inlier=4 --method $W --method turboquant_rvq
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 --burst --method turboquant_rvq --method kivi:bit_width_inlier=4
# The bench (h100_bench_paired.json, h100_bench_128k.json):
python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context 8192,32768 --repeats 2 --decode-tokens 64 --baselines none --warmup full --json
python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --context 131072 --repeats 1 --decode-tokens 64 --baselines none --json
# The waterfill kernel variant (waterfill_lut_*.txt): kvar/orig = a copy of veloxquant_mlx/cache/kernels at HEAD,
# the package = HEAD + waterfill_lut_mantissa.patch (before its shadowing fix)
python3 scripts/decode_kernel_variants.py --context 32768,131072 --extra 0,17 kvar/orig veloxquant_mlx/cache/kernels
NCU=1 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:waterfill python3 scripts/decode_kernel_variants.py --context 32768,131072 --extra 0 kvar/orig veloxquant_mlx/cache/kernels
