# H200 runs of session 24 (after `mkdir -p /root/stash && cp .gpu/a/* /root/stash/` with .gpu/a carried; then
# .gpu/b and .gpu/c carried for `install`). The tree had session 22's kivi_mma_nospill.patch applied;
# kvar/orig = veloxquant_mlx/cache/kernels before it; kvar/rolled = the tree's kernels with
# `#pragma unroll 2` -> `#pragma unroll 1` in kivi.py (untracked copies).
VARIANTS="kvar/orig kvar/rolled" bash scripts/gpu_run.sh install kivitest kpaired   # -> kivitest.txt, kpaired.txt
