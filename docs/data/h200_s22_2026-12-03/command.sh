# H200 runs of session 22 (kvar/old = the kernels of d30a584; kvar/b3 = this commit's with the tensor-core kernel's
# __launch_bounds__ at 3 blocks per SM instead of 4). After `cp .gpu/a/* /root/stash/` in a first call:
CONTEXTS=8192,32768,131072 VARIANTS="kvar/old veloxquant_mlx/cache/kernels" bash scripts/gpu_run.sh install kivitest variants
#   -> variants_kivi_mma.txt, kivitest_first.txt (before float32 queries kept the float32 kernel)
bash scripts/gpu_run.sh install; python3 -m pytest -q tests/test_decode_kernels.py tests/test_kivi_batch.py \
  -k "tensor_core or ragged or kivi_kernel_equals or kivi_batch_kernel"   # -> kivitest_after_dtype_rule.txt
bash scripts/gpu_run.sh - steadyk                                         # -> h200_bench_steady_kivi_r1.json
CONTEXTS=32768,131072 VARIANTS="kvar/old veloxquant_mlx/cache/kernels kvar/b3" bash scripts/gpu_run.sh install variants
REPEATS=3 bash scripts/gpu_run.sh - steadyk                               # -> variants_kivi_mma_bounds3.txt, h200_bench_steady_kivi_r3.json
bash scripts/gpu_run.sh install; CONTEXTS=8192,32768 REPEATS=2 bash scripts/gpu_run.sh - pin
#   -> pin.txt (one socket, one NUMA node), h200_bench_steady_kivi_pinned_{0-7,8-15}.json
bash scripts/gpu_run.sh install; CONTEXTS=131072 REPEATS=3 bash scripts/gpu_run.sh - steadyk   # -> h200_bench_steady_kivi_128k_r3.json
# (an ncu run of both KIVI kernels at 32k/128k ran past its 230 s limit before Nsight printed: no data)
# Next H200 run (prepared, not run): the two unmeasured variants of the tensor-core KIVI kernel against this commit's
#   for v in nospill prefetch; do cp -r veloxquant_mlx/cache/kernels kvar/$v; (cd kvar/$v && patch -p4 < \
#     ../../docs/data/h200_s22_2026-12-03/kivi_mma_$v.patch); done
#   CONTEXTS=8192,32768,131072 VARIANTS="veloxquant_mlx/cache/kernels kvar/nospill kvar/prefetch" bash scripts/gpu_run.sh install variants
# nospill: query fragments in shared memory, key slices and value k-slices unrolled by two (no spill at d 128);
# prefetch: each tile's value words fetched into shared memory with cp.async while its keys are read (no spill at
# d 128 r 4; 31 KB of shared memory a block). Both compile here (scripts/check_decode_kernels.py).
# And the host-spread experiment: bash scripts/gpu_run.sh install graphs
