# first run: mkdir -p /root/stash && cp .gpu/a/* /root/stash/   (carry .gpu/a); then, carry .gpu/b .gpu/c:
FILES="tests/test_quant_contract.py tests/test_waterfill.py tests/test_turboquant_rvq.py tests/test_kivi.py tests/test_quant_variants.py tests/test_lowrank.py tests/test_contract.py tests/test_palu.py" SHARDS=8 SHARD_TIMEOUT=420 bash scripts/gpu_run.sh install suite
ROUNDS=1 ALLDEC_TIMEOUT=540 bash scripts/gpu_run.sh - alldec                       # alldec_h100.txt
# eviction_paired_old_new.txt (old_s39: `git archive 8d55a8a veloxquant_mlx scripts` unpacked, untracked):
export PYTHONPATH=/root/site:$PWD VELOXQUANT_OFFLINE=1
for t in old_s39 . old_s39 .; do python3 $t/scripts/decode_model_cpu.py --shape smollm2 --context 8192 --steps 16 \
    --rounds 5 --prefill --method snapkv --method chunkkv; done
for env in "" "MALLOC_TOP_PAD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_MMAP_THRESHOLD_=33554432"; do
  env $env python3 scripts/kernel_call_host.py --calls 3000; done                   # kernel_call_host.txt
