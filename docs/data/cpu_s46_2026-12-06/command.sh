# Session 46 (2026-12-06), this 2-core Intel Xeon (AVX-512); the tree at 7d76a65 (TurboQuant-RVQ's CPU encoder waiting
# for a prompt's codes before the layer's attention is queued). bench_2k.json:
veloxquant bench --method turboquant_rvq --context 2048 --repeats 2 --decode-tokens 32 --baselines none --json
# A decode step's end in one primitive (joint_finish): decode_model_4k_before.txt at d930b64 (a worktree, run first),
# decode_model_4k.txt with joint_finish, the same minutes (OPENBLAS_THREAD_TIMEOUT=4):
W="waterfill:bit_width_inlier=4,residual_length=16"
python scripts/decode_model_cpu.py --context 4096 --steps 6 --rounds 4 --burst --method turboquant_rvq --method kivi:bit_width_inlier=4 --method $W
# decode_model_16k.txt (with joint_finish; no before run at 16k):
python scripts/decode_model_cpu.py --context 16384 --steps 6 --rounds 3 --burst --method turboquant_rvq --method kivi:bit_width_inlier=4 --method $W
