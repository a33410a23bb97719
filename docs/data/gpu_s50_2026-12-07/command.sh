# Session 50 (2026-12-07), one NVIDIA H100 80GB HBM3 (Intel Xeon host, 16 CPUs), MLX 0.32.4 CUDA, llama-8b's shape
# with random weights, tree at 22b86a6 unless said. Stages of scripts/gpu_run.sh after `cp .gpu/a/* /root/stash/`
# (carry .gpu/a) and `install` (carry .gpu/b, .gpu/c).
bash scripts/gpu_run.sh install timeline            # timeline_128k_as_is.txt: device time per step by kernel, 128k
# variants_{1..4}.txt: copies of veloxquant_mlx/cache/kernels/ in kvar/<X> with one constant changed (KIVI's BLOCKS
# 512 -> 1024 (B) / 256 (D, D2, H) / 128 (F); its key loop unrolled 4 (C, H; E: value loop too); waterfill's
# MMA_MAX_SPLITS 128 -> 64 (P, P2) / 32 (Q); TurboQuant-RVQ's BLOCKS 512 -> 256 (P, P2) / 128 (Q)); A, A2: as is
VARIANTS="kvar/A kvar/B kvar/C kvar/D kvar/E" CONTEXTS=32768,131072 bash scripts/gpu_run.sh - variants
VARIANTS="kvar/A kvar/D kvar/F kvar/H kvar/A2 kvar/D2" CONTEXTS=8192,131072 bash scripts/gpu_run.sh - variants
VARIANTS="kvar/A kvar/D kvar/A2 kvar/D2" CONTEXTS=32768,65536,32768 bash scripts/gpu_run.sh - variants
VARIANTS="kvar/A kvar/P kvar/Q kvar/A2 kvar/P2" CONTEXTS=32768,131072 bash scripts/gpu_run.sh - variants
# the tree with KIVI's BLOCKS = 256 and waterfill's MMA_MAX_SPLITS = 32 (what the variants favoured; reverted after
# the in-model timeline below): the kernels' GPU tests, paired rounds at 128k / 32k, a batch of 8 at 8k
CONTEXTS="131072 32768" ROUNDS=4 ROUNDS128=3 bash scripts/gpu_run.sh - kquick tripaired   # kquick.txt, paired_*.txt
TMO=300 REPEATS=3 bash scripts/gpu_run.sh - gbatch                                         # gbatch*.{txt,json}
# KIVI's batch form alone beside BatchKVCache, BLOCKS 512 / 256 alternated (printed only): 14.8 / 14.3, then 14.0 /
# 14.8 ms a step (BatchKVCache 31.9-32.2 ms): the batch form is indifferent to it
for r in 1 2; do for b in 512 256; do python3 -c "import sys; sys.path.insert(0,'scripts'); \
  import veloxquant_mlx.cache.kernels.kivi as K; K.BLOCKS=$b; import batch_decode as d; d.main(['--shape','llama-8b', \
  '--batch','8','--context','8192','--steps','16','--repeats','3','--method','kivi:bit_width_inlier=4'] \
  + (['--method','none'] if $r == 1 else []))"; done; done
# ab_65536.txt: the whole model, new constants against kvar/old (512 / 128), paired rounds (128k ran out of memory
# with five caches)
python3 scripts/decode_model_cpu.py --shape llama-8b --context 65536 --steps 32 --rounds 3 --burst \
  --method kivi:bit_width_inlier=4 --method kivi:bit_width_inlier=4@kvar/old \
  --method waterfill:bit_width_inlier=4,residual_length=16 --method waterfill:bit_width_inlier=4,residual_length=16@kvar/old
bash scripts/gpu_run.sh - timeline   # timeline_128k_fewer_splits.txt (256 / 32)
# timeline_128k_more_splits.txt: KIVI's BLOCKS = 1024, waterfill's MMA_MAX_SPLITS = 256 (edited on the machine)
METHODS="kivi:bit_width_inlier=4 waterfill:bit_width_inlier=4,residual_length=16" TL_ROWS=3 bash scripts/gpu_run.sh - timeline
