# H200 runs of session 25 (after `mkdir -p /root/stash && cp .gpu/a/* /root/stash/` with .gpu/a carried; then
# .gpu/b and .gpu/c carried for `install`). MLX-CUDA 0.32.4, llama-8b shape, random weights.
bash scripts/gpu_run.sh install cstep                                   # -> cstep_first_machine.txt
REPEATS=3 EXTRA="--method turboquant_rvq" bash scripts/gpu_run.sh install steadyp cstep
#   -> h200_bench_paired.json, steadyp.err, cstep.txt (another machine)
bash scripts/gpu_run.sh install tqsplit                                 # -> tqsplit.txt
python3 scripts/decode_model_cpu.py --shape llama-8b --context 131072 --steps 32 --rounds 3 \
  --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16 \
  --method turboquant_rvq                                               # -> paired128k_s25.txt
# not kept as files (printed only): python3 scripts/decode_host_layer.py --real --context 8192 --calls 2000
#   --rounds 2 --split  (and --rounds 1 --profile), quoted in docs/RESULTS.md
