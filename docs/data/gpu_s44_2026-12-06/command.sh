# Session 44 (2026-12-06), one NVIDIA H100 80GB HBM3 (MLX 0.32.4 CUDA); the tree at 2e22cbf+ (the CPU kernel does not
# run on a GPU: these re-check session 43's waterfill tensor-core form and its shared mma store on a GPU).
# tests_store_h100_timeout.txt (43 passed, none failed, before its 250 s limit) and tests_mma_h100.txt (23 passed):
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "tensor_core or window_kernels or fused_kernel" -W error::RuntimeWarning
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "tensor_core_form or fused_kernel" -W error::RuntimeWarning
# Paired rounds, caches filled directly (paired_8k.txt / paired_8k_r8.txt, paired_32k.txt / paired_32k_r8.txt,
# paired_128k.txt):
W="waterfill:bit_width_inlier=4,residual_length=16"
python3 scripts/decode_model_cpu.py --shape llama-8b --context 8192 --steps 32 --rounds 8 --burst --method kivi:bit_width_inlier=4 --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 32768 --steps 32 --rounds 8 --burst --method kivi:bit_width_inlier=4 --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 --burst --method kivi:bit_width_inlier=4 --method $W
# The bench, each method in its own process (h100_bench.json):
python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --method kivi --set kivi:bit_width_inlier=4 --context 8192,32768 --repeats 2 --decode-tokens 64 --baselines none --isolate --warmup full --json
