# Session 41, this 2-core build machine (MLX 0.32.4 CPU, float32, SmolLM2's shape, random weights, caches filled
# directly). "old" = the tree at 12b6f01 (session 40's end) unpacked beside the repo, "new" = the session's tree;
# the two processes ran one after the other with nothing else running.
mkdir -p /tmp/old && git archive 12b6f01 veloxquant_mlx scripts | tar -x -C /tmp/old
for tree in /tmp/old .; do
  python $tree/scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst \
      --method waterfill:bit_width_inlier=4,residual_length=16                     # waterfill_4k_{old,new}.txt
  python $tree/scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 4 --burst \
      --method waterfill:bit_width_inlier=4,residual_length=16                     # waterfill_16k_{old,new}.txt
  python $tree/scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 3 --burst \
      --method gear --method kvquant --method skvq --method kitty                  # variants_4k_{old,new}.txt
  python $tree/scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 3 --burst \
      --method palu --method svdq --method kvtc --method vecinfer                  # lowrank_vecinfer_4k_{old,new}.txt
  python $tree/scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 4 --burst \
      --method turboquant_rvq                                                      # tq_rvq_4k_{old,new}.txt
done
# one layer (printed only): python scripts/decode_step_cpu.py --context 4096 --steps 48 (and 16384)
# the split on and off in one process (one layer, SmolLM2's attention shape): streams_ab_{4k,16k}.txt
python scripts/cpu_streams_ab.py --context 4096 --rounds 4 --method waterfill --method turboquant_rvq --method gear \
    --method skvq
python scripts/cpu_streams_ab.py --context 16384 --rounds 3 --method waterfill --method turboquant_rvq --method gear
