#!/bin/bash
# session 39, in order of priority: the new tests on the GPU (main tree), ZipCache's decode (main), the
# wip/compiled-rows A/B (wipcr/), every method's decode (main, alldec; progress kept in $OUT/alldec.txt)
export PYTHONPATH=/root/site:$PWD VELOXQUANT_OFFLINE=1
(timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_quant_contract.py -k "returned_rows or decodes_the_codes_once or kvquant or zipcache_gpu" > $OUT/t1.txt 2>&1; tail -3 $OUT/t1.txt) &
(timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_contract.py -k "gpu_decode_steps" > $OUT/t2.txt 2>&1; tail -3 $OUT/t2.txt) &
wait
dec() { timeout $1 python3 scripts/decode_model_cpu.py --shape smollm2 --context 8192 --steps 16 --rounds 2 $(for m in $2; do echo "--method $m"; done) 2>&1 | grep -v "Warn\|rounds:\|^  \.\."; }
echo "== zipcache, main"; dec 40 "zipcache kivi_sink" | tee $OUT/zip_main.txt
cd wipcr; export PYTHONPATH=/root/site:$PWD
echo "== rows on (wipcr)"; dec 45 "gear kivi_sink skvq kitty" | tee $OUT/vdec_on.txt
echo "== rows on, compiled (wipcr)"; VQ_TMP_COMPILE=1 dec 45 "gear kivi_sink skvq kitty" | tee $OUT/vdec_compiled.txt
echo "== palu vecinfer own (wipcr)"; dec 35 "palu vecinfer" | tee $OUT/pv_own.txt
echo "== palu vecinfer rows (wipcr)"; VQ_TMP_ROWS=1 dec 35 "palu vecinfer" | tee $OUT/pv_rows.txt
cd ..; export PYTHONPATH=/root/site:$PWD
ROUNDS=1 ALLDEC_TIMEOUT=${ALLDEC_TIMEOUT:-170} bash scripts/gpu_run.sh - alldec 2>/dev/null
