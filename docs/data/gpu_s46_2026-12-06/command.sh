# Session 46 (2026-12-06), one NVIDIA H100 80GB HBM3 (1980 MHz max), MLX-CUDA 0.32.4, llama-8b shape, random weights.
# kvar/orig = veloxquant_mlx/cache/kernels at 97097fb (before this session's kernel change); kvar/pf = + the warp's
# first tile prefetched into L2 before the block's set-up (keys, values, scales); kvar/ks = the tree at 4e349f2 (keys
# staged in shared memory by cp.async, values and scales into L2); kvar/X128 / X256 = the same with _common's
# TOKENS_PER_WARP 128 / 256 (every kernel's split count).
# tests.txt, variants.txt, ncu.txt (kvar/run2.sh):
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "tensor_core_form or waterfill_window_kernel or waterfill_batch_kernel" -W error::RuntimeWarning
python3 scripts/decode_kernel_variants.py --context 32768,131072 --extra 0 kvar/orig kvar/pf kvar/ks kvar/ks128 kvar/ks256
NCU=1 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats -k regex:waterfill_decode_mma python3 scripts/decode_kernel_variants.py --context 131072 --extra 0 kvar/orig kvar/ks kvar/ks256
# Whole model, paired rounds, caches filled directly:
W="waterfill:bit_width_inlier=4,residual_length=16"; K="kivi:bit_width_inlier=4"
# paired_128k_ks.txt (the tree at 4e349f2; round 1 the plain cache's warm-up):
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 --burst --method $K --method $W
# paired_128k_tpw256.txt, paired_32k_tpw256.txt: the same with TOKENS_PER_WARP = 256 for every kernel (sed on the copy)
# paired_128k_cap.txt, paired_32k.txt, paired_8k.txt: the tree with MMA_MAX_SPLITS = 128 (this commit):
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 5 --burst --method $K --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 32768 --steps 32 --rounds 4 --burst --method $K --method $W
python3 scripts/decode_model_cpu.py --shape llama-8b --context 8192 --steps 32 --rounds 4 --burst --method $K --method $W --method turboquant_rvq
# ab32k_{orig,tree}_{1,2}.txt: waterfill.py swapped between kvar/orig's and the tree's, alternating, 3 rounds each at 32k
# wftest.txt (the tree with the cap):
python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_waterfill_batch.py -k waterfill -W error::RuntimeWarning
