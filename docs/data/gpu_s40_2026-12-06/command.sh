#!/bin/bash
# session 40, an H100 (MLX-CUDA 0.32.4): each part ran after `bash scripts/gpu_run.sh install` (.gpu/b, .gpu/c carried)
# old_s40/ (untracked): veloxquant_mlx/ and scripts/ of 8d55a8a (session 39 end); old_s40/v1, v2: variants (README)
export PYTHONPATH=/root/site:$PWD VELOXQUANT_OFFLINE=1

# --- run1.sh
(timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_observed_attention.py tests/test_eviction_scoring.py > $OUT/t_evict.txt 2>&1; tail -4 $OUT/t_evict.txt) &
M="h2o tova keyformer nestedkv morphkv pyramidkv cam kvzip squeeze snapkv"
dec() { timeout $1 python3 $2/scripts/decode_model_cpu.py --shape smollm2 --context 8192 --steps 16 --rounds 2 --prefill $(for m in $M; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|warn\|rounds:\|self._check\|^  \.\."; }
wait
echo "== before (8d55a8a)"; dec 200 old_s40 | tee $OUT/evict_before.txt
echo "== after"; dec 200 . | tee $OUT/evict_after.txt

# --- run2.sh
M="h2o tova morphkv"
dec() { timeout $1 python3 $2/scripts/decode_model_cpu.py --shape smollm2 --context 8192 --steps 16 --rounds 3 --prefill $(for m in $M; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|warn\|rounds:\|self._check\|^  \.\."; }
for v in old_s40 . old_s40/v1 old_s40/v2 old_s40; do echo "== $v"; dec 100 $v | tee -a $OUT/evict_variants.txt; done

# --- run3.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_observed_decode_kernel.py > $OUT/t_kernel.txt 2>&1; tail -25 $OUT/t_kernel.txt
M="h2o tova pyramidkv nestedkv kvzip cam keyformer"
dec() { timeout $1 python3 scripts/decode_model_cpu.py --shape $2 --context 8192 --steps 16 --rounds $3 --prefill $(for m in $M; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|warn\|rounds:\|self._check\|^  \.\."; }
echo "== smollm2 kernel on"; dec 150 smollm2 3 | tee $OUT/kern_on.txt
echo "== smollm2 kernel off"; VELOXQUANT_DECODE_KERNELS=0 dec 150 smollm2 3 | tee $OUT/kern_off.txt
M="h2o tova"
echo "== llama-8b kernel on"; dec 120 llama-8b 2 | tee $OUT/kern_on_8b.txt
echo "== llama-8b kernel off"; VELOXQUANT_DECODE_KERNELS=0 dec 120 llama-8b 2 | tee $OUT/kern_off_8b.txt

# --- run4.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_observed_decode_kernel.py > $OUT/t_kernel2.txt 2>&1; tail -15 $OUT/t_kernel2.txt
dec() { timeout $1 python3 scripts/decode_model_cpu.py --shape $2 --context 8192 --steps 16 --rounds $3 --prefill $(for m in $M; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|warn\|rounds:\|self._check\|^  \.\."; }
M="h2o tova"
echo "== llama-8b kernel on"; dec 120 llama-8b 2 | tee $OUT/kern2_on_8b.txt
echo "== llama-8b kernel off"; VELOXQUANT_DECODE_KERNELS=0 dec 120 llama-8b 2 | tee $OUT/kern2_off_8b.txt
M="h2o tova pyramidkv nestedkv kvzip cam keyformer"
echo "== smollm2 kernel on"; dec 150 smollm2 3 | tee $OUT/kern2_on.txt
echo "== smollm2 kernel off"; VELOXQUANT_DECODE_KERNELS=0 dec 150 smollm2 3 | tee $OUT/kern2_off.txt

# --- run5.sh (after the test fix)
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_observed_decode_kernel.py > $OUT/t_kernel3.txt 2>&1; tail -3 $OUT/t_kernel3.txt
M="h2o tova pyramidkv kvzip"
dec() { timeout $1 python3 $2/scripts/decode_model_cpu.py --shape $3 --context 8192 --steps 16 --rounds 3 --prefill $(for m in $M; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|warn\|rounds:\|self._check\|^  \.\."; }
for v in old_s40 . old_s40 .; do echo "== llama-8b $v"; dec 150 $v llama-8b | tee -a $OUT/llama8b_before_after.txt; done

# --- run6.sh (old_s40/prev: veloxquant_mlx/ and scripts/ at cdf15ba, before kernels.drop_row)
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_observed_decode_kernel.py > $OUT/t_kernel4.txt 2>&1; tail -15 $OUT/t_kernel4.txt
M="tova morphkv"
dec() { timeout $1 python3 $2/scripts/decode_model_cpu.py --shape $3 --context 8192 --steps 16 --rounds 3 --prefill $(for m in $M; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|warn\|rounds:\|self._check\|^  \.\."; }
for v in old_s40/prev . old_s40/prev .; do echo "== llama-8b $v"; dec 100 $v llama-8b | tee -a $OUT/drop_llama8b.txt; done
for v in old_s40/prev . ; do echo "== smollm2 $v"; dec 80 $v smollm2 | tee -a $OUT/drop_smollm2.txt; done

# --- run7.sh (the eviction, memory and kernel test files on the GPU, 8 shards)
FILES="tests/test_eviction_layers.py tests/test_eviction_contract.py tests/test_eviction_query.py tests/test_eviction_scoring.py tests/test_observed_attention.py tests/test_memory_honesty.py tests/test_observed_decode_kernel.py tests/test_prefill_memory.py" SHARDS=8 SHARD_TIMEOUT=240 bash scripts/gpu_run.sh - suite 2>/dev/null
grep -h "passed\|failed" $OUT/suite_*.txt
