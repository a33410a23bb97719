# Session 42 (2026-12-06), this 2-core Intel Xeon (MLX 0.32.4 CPU, OpenBLAS preloaded), SmolLM2's shape, float32.
# Whole model, KIVI-4 and waterfill-4 against the plain cache, with OpenBLAS's default worker spin and with
# OPENBLAS_THREAD_TIMEOUT=4 (decode_model_4k_blas_timeout.txt):
for E in "" "OPENBLAS_THREAD_TIMEOUT=4"; do
  env $E python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16
done
# 16k (decode_model_16k.txt):
python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 4 --burst --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16
# One layer, KIVI's decode with its contractions split one after the other ("parts") or each range's softmax on its own
# stream ("alone": a prototype of FlashDecoding's split, not kept), interleaved (ab_alone_*.txt; ab_alone.py needs the
# prototype's GroupedQuantCache._codes_alone, so it runs only on that tree):
python ab_alone.py 4096 14 kivi
OPENBLAS_THREAD_TIMEOUT=4 python ab_alone.py 4096 10 kivi
# Session 35's tree (3a9a0ec) and HEAD, one after the other (decode_model_4k_s35_tree_vs_head.txt):
git archive 3a9a0ec veloxquant_mlx scripts | tar -x -C /tmp/old35
(cd /tmp/old35 && python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method kivi:bit_width_inlier=4)
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method kivi:bit_width_inlier=4
# waterfill with rope.angle_tables memoized across layers and steps (a prototype, rope_memo.py; not kept):
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 6 --burst --method waterfill:bit_width_inlier=4,residual_length=16
python rope_memo.py --context 4096 --steps 6 --rounds 6 --burst --method waterfill:bit_width_inlier=4,residual_length=16
