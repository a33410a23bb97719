# Session 45 (2026-12-06), the same 2-core Intel Xeon as session 44 (AVX-512; MLX 0.32.4 CPU, OpenBLAS preloaded),
# SmolLM2's shape, float32; the CPU kernels (veloxquant_mlx/cache/native, g++ 12, -march=native) now with
# TurboQuant-RVQ's (turboquant_rvq_cpu.cpp).
# Whole model, caches filled directly (decode_model_4k.txt, decode_model_16k.txt; decode_model_4k_op_path.txt: the
# kernels off, TurboQuant-RVQ's op path):
W="waterfill:bit_width_inlier=4,residual_length=16"
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method turboquant_rvq --method kivi:bit_width_inlier=4 --method $W
python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 4 --burst --method turboquant_rvq --method kivi:bit_width_inlier=4 --method $W
VELOXQUANT_CPU_KERNELS=0 python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method turboquant_rvq
# One layer, the plain cache, TurboQuant-RVQ's op path on one and two streams, and its kernel (one_layer_4k.txt,
# one_layer_16k.txt):
OPENBLAS_THREAD_TIMEOUT=4 python scripts/cpu_streams_ab.py --context 4096 --rounds 4 --method turboquant_rvq
OPENBLAS_THREAD_TIMEOUT=4 python scripts/cpu_streams_ab.py --context 16384 --rounds 4 --method turboquant_rvq
# The kernels built for other targets (AVX2, baseline x86-64) and their tests run on each:
python -m pytest -q tests/test_native_cpu.py -k avx2
# After the CPU encoder (decode_model_4k_encoder.txt):
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method turboquant_rvq --method kivi:bit_width_inlier=4 --method $W
# Prefill, 8 layers (prefill_4k.txt; prefill_4k_op_path.txt the kernels off):
python scripts/prefill_peak.py --layers 8 --contexts 4096 --steps 1024 --methods none,turboquant_rvq --warm
VELOXQUANT_CPU_KERNELS=0 python scripts/prefill_peak.py --layers 8 --contexts 4096 --steps 1024 --methods none,turboquant_rvq --warm
# The bench (bench_2k.json; bench_2k_op_path.json the kernels off), before the encoder's prefill wait:
veloxquant bench --method turboquant_rvq --context 2048 --repeats 2 --decode-tokens 32 --baselines none --json
VELOXQUANT_CPU_KERNELS=0 veloxquant bench --method turboquant_rvq --context 2048 --repeats 2 --decode-tokens 32 --baselines none --json
# One chunk's peak, before / after that wait and with the kernels off (figures in docs/RESULTS.md):
python scripts/prefill_peak.py --contexts 2048 --steps 2048 --methods none,turboquant_rvq
VELOXQUANT_CPU_KERNELS=0 python scripts/prefill_peak.py --contexts 2048 --steps 2048 --methods turboquant_rvq
