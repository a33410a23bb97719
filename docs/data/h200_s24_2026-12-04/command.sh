# H200 runs of session 24 (after `mkdir -p /root/stash && cp .gpu/a/* /root/stash/` with .gpu/a carried; then
# .gpu/b and .gpu/c carried for `install`). The tree had session 22's kivi_mma_nospill.patch applied;
# kvar/orig = veloxquant_mlx/cache/kernels before it; kvar/rolled = the tree's kernels with
# `#pragma unroll 2` -> `#pragma unroll 1` in kivi.py (untracked copies).
VARIANTS="kvar/orig kvar/rolled" bash scripts/gpu_run.sh install kivitest kpaired   # -> kivitest.txt, kpaired.txt
# waterfill's 8k prefill (1.38x in session 23): where a chunk's time goes, before any change
bash scripts/gpu_run.sh install wsync pcostw    # -> wsync.txt (prefill_host_device.py --method waterfill --profile,
                                                #    LAYERS_IN_FLIGHT 4 / 32), pcostw.txt
CONTEXT=8192 bash scripts/gpu_run.sh install wlayers   # -> wlayers.txt (prefill_layer_split.py: every layer synced)
# after "a cache's first chunk waits for nothing" (contract.queue_chunk_check(wait=False))
bash scripts/gpu_run.sh install psplit pbench   # -> psplit_first_chunk.txt, h200_bench_prefill_first_chunk.json
# after the RoPE and codebook constants are shared by the layers (rope_frequencies / rope_tables / odd_poly_gaussian)
CONTEXTS=8192 bash scripts/gpu_run.sh install psplit pbench   # -> psplit_rope_shared.txt, h200_bench_prefill_rope_shared.json
python3 -m pytest -q tests/test_decode_kernels.py -k "waterfill or rope or rows_kernel or take_the_kernels"  # 58 passed
