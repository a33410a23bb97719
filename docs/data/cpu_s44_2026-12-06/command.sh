# Session 44 (2026-12-06), this 2-core Intel Xeon (MLX 0.32.4 CPU, OpenBLAS preloaded), SmolLM2's shape, float32;
# waterfill's CPU kernel (veloxquant_mlx/cache/native, built here with g++ 12, -march=native: AVX-512).
# One layer, the plain cache, waterfill's op path on one and two streams, and the kernel, interleaved
# (one_layer_4k.txt, one_layer_16k.txt):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/cpu_streams_ab.py --context 4096 --rounds 6 --method waterfill
OPENBLAS_THREAD_TIMEOUT=4 python scripts/cpu_streams_ab.py --context 16384 --rounds 4 --method waterfill
# Whole model, caches filled directly (decode_model_4k.txt, decode_model_16k.txt; *_op_path.txt: the kernel off):
W="waterfill:bit_width_inlier=4,residual_length=16"
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method kivi:bit_width_inlier=4 --method $W
VELOXQUANT_CPU_KERNELS=0 python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method $W
python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 4 --burst --method kivi:bit_width_inlier=4 --method $W
VELOXQUANT_CPU_KERNELS=0 python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 4 --burst --method $W
# After KIVI's kernel (decode_model_4k_kivi_kernel.txt, decode_model_16k_kivi_kernel.txt; decode_model_4k_kivi_op_path.txt
# the kernels off):
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method kivi:bit_width_inlier=4 --method $W
VELOXQUANT_CPU_KERNELS=0 python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method kivi:bit_width_inlier=4
python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 4 --burst --method kivi:bit_width_inlier=4 --method $W
