# Session 43 (2026-12-06), one NVIDIA H100 80GB HBM3; the tree at fad6f08 (waterfill's tensor-core form, every row
# read through a clamp). kvar/orig = veloxquant_mlx/cache/kernels at ae53e9a (session 42's end):
#   mkdir -p kvar/orig && git archive ae53e9a veloxquant_mlx/cache/kernels | tar -x -C /tmp && cp /tmp/veloxquant_mlx/cache/kernels/*.py kvar/orig/
# tests_mma1_h100.txt (its waterfill_rows warnings: the prefill kernels' unpacking of the new 4-table RoPE tuple,
# fixed in the next commit; they fell back to the op path):
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "tensor_core_form or window_kernels or fused_kernel or waterfill_batch_kernel"
# variants_mma1_h100.txt:
python3 scripts/decode_kernel_variants.py --context 8192,32768 --extra 0,17 kvar/orig veloxquant_mlx/cache/kernels
# Then at 8936853 + the line split (the tree's tensor-core form: full tiles at constant offsets), on another H100
# (kvar/mma1 = the kernels package at fad6f08), tests_h100.txt:
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "tensor_core_form or prefill_kernels or window_kernels" -W error::RuntimeWarning
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "waterfill_prefill_kernels or waterfill_batch_kernel" -W error::RuntimeWarning
# ncu_single_call_h100.txt (one call per kernel, unfixed clocks: see RESULTS for why these are not the figures):
NCU=1 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:waterfill python3 scripts/decode_kernel_variants.py --context 32768,131072 --extra 0 kvar/orig kvar/mma1 veloxquant_mlx/cache/kernels
# Paired rounds, caches filled directly (paired_8k.txt, paired_32k.txt, paired_128k.txt; paired_128k_r2.txt the first
# 128k run, whose round 1 was the plain cache's warm-up):
W="waterfill:bit_width_inlier=4,residual_length=16"
python3 scripts/decode_model_cpu.py --shape llama-8b --context 8192 --steps 32 --rounds 4 --burst --method kivi:bit_width_inlier=4 --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 32768 --steps 32 --rounds 3 --burst --method kivi:bit_width_inlier=4 --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 --burst --method kivi:bit_width_inlier=4 --method $W
