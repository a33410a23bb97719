# run from the repository root; output: stdout.txt, results.md/json, pareto.png (this folder)
python -m veloxquant_mlx eval --task kld --context 2048 \
  --method "waterfill bit_width_inlier=2 residual_length=32" \
  --method "kivi bit_width_inlier=2" \
  --method "snapkv budget=1024 quantize=waterfill bit_width_inlier=4 residual_length=16" \
  --method "snapkv budget=1024 quantize=waterfill bit_width_inlier=3 residual_length=16" \
  --method "snapkv budget=896 quantize=waterfill bit_width_inlier=4 residual_length=16" \
  --method "snapkv budget=1228 quantize=waterfill bit_width_inlier=3 residual_length=16" \
  --method "pyramidkv budget=1024 quantize=waterfill bit_width_inlier=3 residual_length=16" \
  --method "snapkv budget=1024 quantize=kivi bit_width_inlier=4" \
  --out docs/data/composed_kld_2048_2026-12-03
