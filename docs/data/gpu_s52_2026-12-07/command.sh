# Session 52 (2026-12-07), one NVIDIA H100 80GB HBM3 (host: "Intel(R) Xeon(R) Processor", 16 cores, pin.txt), MLX
# 0.32.4 CUDA, llama-8b's shape with random weights, tree at 910efc4. After `cp .gpu/a/* /root/stash/` (carry .gpu/a)
# and `install` (carry .gpu/b, .gpu/c):
bash scripts/gpu_run.sh install pin    # pin.txt; KIVI-4's bench at 32k pinned to cores 0-7 / 8-15: pin_0-7.json, pin_8-15.json
CONTEXTS="8192 32768" ROUNDS=4 TMO=250 bash scripts/gpu_run.sh - tripaired    # paired_8192.txt, paired_32768.txt
# gtest.txt: session 51's methods (SVDq, KVTC, xKV, AMC, NSNQuant, CacheGen) on the CUDA backend (their CPU kernels
# are not taken there; the GPU paths they share were untouched):
export PYTHONPATH=/root/site:$PWD VELOXQUANT_OFFLINE=1
python3 -m pytest -q -p no:cacheprovider -rfE tests/test_lowrank.py tests/test_crosslayer.py tests/test_anchor_nsn.py \
  tests/test_cachegen_amc.py > gtest.txt    # 81 passed, 7 skipped (the skips need the embedded model: offline)
