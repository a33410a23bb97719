# Session 49 (2026-12-07), one NVIDIA H100 80GB HBM3 (its host's pace varied between runs: the plain cache 93-142
# tok/s at 8k-32k), MLX 0.32.4 CUDA, llama-8b's shape with random weights; at 6fd9093..84062b4. Stages of
# scripts/gpu_run.sh after `cp .gpu/a/* /root/stash/` (carry .gpu/a) and `install` (carry .gpu/b, .gpu/c):
bash scripts/gpu_run.sh install bktest   # bktest.txt: the batch kernels, take_the_kernels, kivi_sink on the GPU
bash scripts/gpu_run.sh - tripaired      # paired_{8192,32768,131072}.txt
bash scripts/gpu_run.sh - gbatch         # gbatch.txt / gbatch_8x8192.json: batch of 8 at 6400..8192 tokens
# ks_{8192,32768}.txt: kivi_sink (defaults, 2-bit) beside KIVI (defaults) and age_tiered
for T in 8192 32768; do python3 scripts/decode_model_cpu.py --shape llama-8b --context $T --steps 32 --rounds 3 \
  --method kivi_sink --method kivi --method age_tiered; done
# ksab_{T}_{True,False}.txt: kivi_sink with its kernel route (True) and with the class flag off (False: the rows
# update_and_fetch returned, MLX's fused attention, as before this session)
for T in 8192 32768; do for own in True False; do python3 -c "import sys; sys.argv=['x','--shape','llama-8b', \
  '--context','$T','--steps','32','--rounds','3','--method','kivi_sink']; sys.path.insert(0,'scripts'); \
  from veloxquant_mlx.cache.methods.quantization.kivi_sink import KIVISinkKVCache as K; \
  K.own_codes_after_lead_rows=$own; import decode_model_cpu as d; d.main()"; done; done
CONTEXTS=8192,32768 REPEATS=2 EXTRA="--method turboquant_rvq" bash scripts/gpu_run.sh - steadyp  # h100_bench_paired.json
# paired2_{8192,32768,131072}.txt: the same `tripaired` again at 066ae7b, an hour later on a fresh H100 machine
# (Intel Xeon host, 16 CPUs), 5 rounds at 8k / 32k, 3 at 128k:
CONTEXTS="8192 32768 131072" ROUNDS=5 ROUNDS128=3 bash scripts/gpu_run.sh - tripaired
