# H200 runs of session 23 (after `mkdir -p /root/stash && cp .gpu/a/* /root/stash/` with .gpu/a carried; then
# .gpu/b and .gpu/c carried for `install`). kvar/* = copies of veloxquant_mlx/cache/kernels (untracked):
#   nospill:  patch -p4 < docs/data/h200_s22_2026-12-03/kivi_mma_nospill.patch
#   prefetch: kivi_mma_prefetch_aligned.patch here (s22's patch + __align__(16) on the shared value tile)
#   b1024, b2048: BLOCKS = 1024 / 2048 in kivi.py
bash scripts/gpu_run.sh install graphs                                      # -> graphs_*.json
CONTEXTS=8192,32768,131072 VARIANTS="veloxquant_mlx/cache/kernels kvar/nospill kvar/prefetch" \
  bash scripts/gpu_run.sh - variants                                        # -> variants_prefetch_misaligned.txt
CONTEXTS=8192,32768,131072 VARIANTS="veloxquant_mlx/cache/kernels kvar/nospill" bash scripts/gpu_run.sh - variants
#   -> variants_nospill.txt
CONTEXTS=8192,32768,131072 VARIANTS="veloxquant_mlx/cache/kernels kvar/prefetch kvar/b1024 kvar/b2048" \
  bash scripts/gpu_run.sh install variants                                  # -> variants_prefetch_blocks.txt
ROUNDS=5 bash scripts/gpu_run.sh install paired                             # -> paired.txt
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 \
  --method kivi:bit_width_inlier=4                                          # -> paired128k.txt
python3 scripts/decode_host_device.py --context 131072 --method kivi --pipelined   # -> hdp128k.txt
bash scripts/gpu_run.sh install steadyp                                     # -> h200_bench_paired.json, steadyp.err
python3 scripts/decode_host_device.py --context 8192 --method kivi --pipelined     # -> hdp8k.txt
python3 scripts/decode_host_layer.py --real --method kivi --context 8192 --calls 2000 --profile  # -> layer_kivi.txt
