# Session 46 (2026-12-06), this 2-core Intel Xeon (AVX-512); the tree at 7d76a65 (TurboQuant-RVQ's CPU encoder waiting
# for a prompt's codes before the layer's attention is queued). bench_2k.json:
veloxquant bench --method turboquant_rvq --context 2048 --repeats 2 --decode-tokens 32 --baselines none --json
