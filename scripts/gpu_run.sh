#!/bin/bash
# The H200 runs of sessions 6-13 (see ../shared/docs/GPU.md): after `cp .gpu/a/* /root/stash/` in a first run, run
# `bash scripts/gpu_run.sh install ktest bench2` (stages below) with `.gpu/b` and `.gpu/c` carried; outputs land in $OUT. On a
# machine still warm from an install, pass `-` instead of `install` (e.g. `REPEATS=3 BENCH_ARGS="--warmup full"
# bash scripts/gpu_run.sh - noise`; PYTHONPATH=/root/site:$PWD is set below). Kernel variants: copies of
# veloxquant_mlx/cache/kernels/ in untracked folders, `VARIANTS="kvar/A kvar/B" bash scripts/gpu_run.sh - variants ncu`.
# The machine is handed back after ~30 s idle: chain the runs (prepare everything first).
set -x
export PYTHONPATH=/root/site:$PWD
export VELOXQUANT_OFFLINE=1  # no PyPI there: tests needing SmolLM2 or the essays skip (tests/conftest.py)
case "$1" in
install)
  cat /root/stash/part_aa .gpu/b/part_ab > /root/stash/$(cat .gpu/b/WHEEL_NAME) && rm /root/stash/part_aa
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site /root/stash/*.whl
  # constriction (CacheGen's entropy coder; the package imports it): `pip download --no-deps --only-binary=:all:
  # --python-version 3.12 --platform manylinux2014_x86_64 -d .gpu/c constriction` here, `.gpu/c` carried
  if ls .gpu/c/*.whl > /dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .gpu/c/*.whl; fi
  python3 -c "import mlx.core as mx; print(mx.default_device(), mx.__version__)"
  ;;
esac
shift
for cmd in "$@"; do
  case "$cmd" in
  ktest) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "kernel" > $OUT/ktest.txt 2>&1; tail -25 $OUT/ktest.txt ;;
  order) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_quant_contract.py -k "evaluated_together or fused_kernel_equals or launch_routes or gpu_decode_step or take_the_kernels" > $OUT/order.txt 2>&1; grep -E "^FAILED|passed|failed" $OUT/order.txt ;;  # session 54: a cache's fused launches ordered (vq_after)
  kquick) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "kernel_equals or take_the_kernels or decoding_of_the_codes" > $OUT/kquick.txt 2>&1; tail -5 $OUT/kquick.txt ;;
  ktime) timeout 200 python3 scripts/decode_kernel_time.py --context 8192,32768,131072 --old-kernels .gpu/old --host > $OUT/decode_kernel_time.txt 2>&1; cat $OUT/decode_kernel_time.txt ;;
  benchk) timeout 400 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --context 8192,32768 --repeats 2 --decode-tokens 16 --baselines none --isolate --json > $OUT/bench_kivi.json; tail -c 3000 $OUT/bench_kivi.json ;;
  cost) for m in kivi waterfill; do for T in 8192 32768; do timeout 200 python3 scripts/decode_step_cost.py --method $m --context $T; timeout 200 python3 scripts/decode_step_cost.py --method $m --context $T --reuse-meta; done; done > $OUT/cost.txt 2>&1; cat $OUT/cost.txt ;;
  hd) (timeout 250 python3 scripts/decode_host_device.py --context 8192 --method kivi --profile; timeout 200 python3 scripts/decode_host_device.py --context 32768 --method kivi; timeout 200 python3 scripts/decode_host_device.py --context 8192 --method waterfill --profile) > $OUT/hd.txt 2>&1; grep -v "^ *[0-9].*{built-in\|^$" $OUT/hd.txt | head -120 ;;
  bench1) timeout 270 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --method kivi --set kivi:bit_width_inlier=4 --context 8192,32768 --repeats 1 --decode-tokens 16 --baselines none --isolate --json > $OUT/h200_bench.json 2> $OUT/bench1.err; tail -3 $OUT/bench1.err; python3 scripts/bench_samples.py $OUT/h200_bench.json ;;
  bench2) timeout 560 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --method kivi --set kivi:bit_width_inlier=4 --context 8192,32768 --repeats 2 --decode-tokens 16 --baselines none --isolate --json > $OUT/h200_bench.json 2> $OUT/bench2.err; tail -5 $OUT/bench2.err; python3 scripts/bench_samples.py $OUT/h200_bench.json ;;
  bench128) timeout 580 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --context 131072 --repeats 1 --decode-tokens 8 --baselines none --isolate --timeout 280 --json > $OUT/h200_bench_128k.json 2> $OUT/bench128.err; tail -5 $OUT/bench128.err; python3 scripts/bench_samples.py $OUT/h200_bench_128k.json ;;
  batch) timeout 400 python3 scripts/batch_capacity.py --shape llama-8b --context 32768 --budget-gb 120 --steps 16 --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16 --json $OUT/h200_batch_32k.json > $OUT/batch.txt 2>&1; cat $OUT/batch.txt ;;
  batchw) timeout 300 python3 scripts/batch_capacity.py --shape llama-8b --context 32768 --budget-gb 120 --steps 16 --no-plain --method waterfill:bit_width_inlier=4,residual_length=16 --json $OUT/h200_batch_32k_waterfill.json > $OUT/batchw.txt 2>&1; cat $OUT/batchw.txt ;;
  bench128w) timeout 400 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context 131072 --repeats 1 --decode-tokens 8 --baselines none --isolate --timeout 280 --json > $OUT/h200_bench_128k_waterfill.json 2> $OUT/bench128w.err; tail -5 $OUT/bench128w.err; python3 scripts/bench_samples.py $OUT/h200_bench_128k_waterfill.json ;;
  pcost) (for m in "kivi" "waterfill --set residual_length=16"; do timeout 150 python3 scripts/prefill_chunk_cost.py --method $m --context 8192,30720 --profile; done) > $OUT/pcost.txt 2>&1; grep -v "^ *[0-9].*{built-in\|^$" $OUT/pcost.txt | head -150 ;;
  rtest) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "prefill_kernels or waterfill_kernel_equals or rows_kernel or kivi_kernel_equals" > $OUT/rtest.txt 2>&1; tail -15 $OUT/rtest.txt ;;
  pcostw) timeout 150 python3 scripts/prefill_chunk_cost.py --method waterfill --set residual_length=16 --context 8192,30720 > $OUT/pcostw.txt 2>&1; cat $OUT/pcostw.txt ;;
  pcostk) timeout 150 python3 scripts/prefill_chunk_cost.py --method kivi --context 8192,30720 > $OUT/pcostk.txt 2>&1; cat $OUT/pcostk.txt ;;
  noise) timeout 570 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --method kivi --set kivi:bit_width_inlier=4 --context 8192,32768 --repeats ${REPEATS:-3} --decode-tokens ${DECODE:-16} --baselines none --isolate --json $BENCH_ARGS > $OUT/h200_bench_noise.json 2> $OUT/noise.err; tail -3 $OUT/noise.err; python3 scripts/bench_samples.py $OUT/h200_bench_noise.json ;;
  sync) timeout 300 python3 scripts/prefill_host_device.py --context 8192,32768 > $OUT/sync.txt 2>&1; cat $OUT/sync.txt ;;
  b128) timeout 420 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context 131072 --repeats 1 --decode-tokens 8 --baselines none --isolate --timeout 200 --json > $OUT/h200_bench_128k.json 2> $OUT/b128.err; tail -3 $OUT/b128.err; python3 scripts/bench_samples.py $OUT/h200_bench_128k.json ;;
  inflight) VELOXQUANT_PREFILL_LAYERS_IN_FLIGHT=${INFLIGHT:-4} timeout 200 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context 8192,32768 --repeats 2 --decode-tokens 8 --baselines none --isolate --warmup full --json > $OUT/h200_bench_inflight.json 2> $OUT/inflight.err; tail -3 $OUT/inflight.err; python3 scripts/bench_samples.py $OUT/h200_bench_inflight.json ;;
  variants) timeout 300 python3 scripts/decode_kernel_variants.py --context ${CONTEXTS:-8192,32768,131072} $VARIANTS > $OUT/variants.txt 2>&1; cat $OUT/variants.txt ;;
  ncu) NCU=1 timeout 400 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats -k regex:decode python3 scripts/decode_kernel_variants.py --context ${CONTEXTS:-8192,32768} --extra 0 $VARIANTS > $OUT/ncu.txt 2>&1; grep -E "^  vq_|Duration|Compute \(SM\)|Warp Cycles Per Issued|Registers Per|Achieved Occ|^T=|relative L2" $OUT/ncu.txt ;;
  layer) (timeout 200 python3 scripts/decode_host_layer.py --real --context 8192 --calls 3000 --profile; timeout 100 python3 scripts/decode_host_layer.py --context 8192 --calls 3000) > $OUT/layer.txt 2>&1; grep -v "^$" $OUT/layer.txt | head -80 ;;
  hdp) (for T in 8192 32768; do timeout 200 python3 scripts/decode_host_device.py --context $T --method kivi --pipelined; done; timeout 200 python3 scripts/decode_host_device.py --context 8192 --method waterfill --set residual_length=16 --pipelined) > $OUT/hdp.txt 2>&1; grep -v "^$" $OUT/hdp.txt | grep -v Warn | head -70 ;;
  ftest) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "fused or kernel_equals or take_the_kernels or batch" > $OUT/ftest.txt 2>&1; tail -8 $OUT/ftest.txt ;;
  tqtest) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "turboquant or rvq or take_the_kernels" > $OUT/tqtest.txt 2>&1; tail -12 $OUT/tqtest.txt ;;
  tqbench) timeout 570 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method turboquant_rvq --context ${CONTEXTS:-8192,32768} --repeats ${REPEATS:-2} --decode-tokens ${DECODE:-16} --baselines none --isolate --warmup full --json $BENCH_ARGS > $OUT/h200_bench_tq.json 2> $OUT/tqbench.err; tail -3 $OUT/tqbench.err; python3 scripts/bench_samples.py $OUT/h200_bench_tq.json ;;
  pcostq) (timeout 200 python3 scripts/prefill_chunk_cost.py --method turboquant_rvq --context ${CONTEXTS:-8192,30720} --repeats 3; VELOXQUANT_DECODE_KERNELS=0 timeout 200 python3 scripts/prefill_chunk_cost.py --method turboquant_rvq --context ${CONTEXTS:-8192,30720} --repeats 3) > $OUT/pcostq.txt 2>&1; grep -v Warn $OUT/pcostq.txt ;;
  tqhd) (for T in ${CONTEXTS:-8192 32768}; do timeout 250 python3 scripts/decode_host_device.py --context $T --method turboquant_rvq --pipelined; done) > $OUT/tqhd.txt 2>&1; grep -v "^$" $OUT/tqhd.txt | grep -v Warn | head -60 ;;
  wftest) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py -k "waterfill or take_the_kernels or fused" > $OUT/wftest.txt 2>&1; grep -E "^FAILED|passed|failed|Error" $OUT/wftest.txt | head -20 ;;
  batchtests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_waterfill_batch.py tests/test_kivi_batch.py tests/test_turboquant_rvq_batch.py tests/test_streaming_llm_batch.py > $OUT/batchtests.txt 2>&1; grep -E "^FAILED|passed|failed" $OUT/batchtests.txt ;;
  steady) timeout 500 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --method kivi --set kivi:bit_width_inlier=4 --method turboquant_rvq --context 8192,32768 --repeats 2 --decode-tokens 128 --baselines none --isolate --json > $OUT/h200_bench_steady.json 2> $OUT/steady.err; tail -3 $OUT/steady.err; python3 scripts/bench_samples.py $OUT/h200_bench_steady.json ;;
  steady128) timeout 500 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context 131072 --repeats 1 --decode-tokens 128 --baselines none --isolate --timeout 250 --json > $OUT/h200_bench_steady_128k.json 2> $OUT/steady128.err; tail -3 $OUT/steady128.err; python3 scripts/bench_samples.py $OUT/h200_bench_steady_128k.json ;;
  callhost) timeout 60 python3 scripts/kernel_call_host.py > $OUT/callhost.txt 2>&1; cat $OUT/callhost.txt ;;
  unroll) (for m in ${METHODS:-turboquant_rvq kivi}; do D="scripts/decode_host_device.py --context ${CONTEXT:-8192} --method $m --pipelined";
    echo "== $m as is"; timeout 100 python3 $D;
    echo "== $m counted loops unrolled 2"; timeout 100 python3 $D --pragma "unroll 4=>unroll 2" --pragma "unroll 8=>unroll 2" --pragma "unroll 16=>unroll 2";
    echo "== $m every loop rolled"; timeout 100 python3 $D --pragma "unroll=>unroll 1" --pragma "unroll 2=>unroll 1" --pragma "unroll 4=>unroll 1" --pragma "unroll 8=>unroll 1" --pragma "unroll 16=>unroll 1";
    done) > $OUT/unroll.txt 2>&1; grep -v "^$" $OUT/unroll.txt | grep -v Warn ;;
  evar) timeout 200 python3 scripts/encode_kernel_variants.py $VARIANTS > $OUT/evar.txt 2>&1; cat $OUT/evar.txt ;;
  encncu) NCU=1 timeout 300 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats -k regex:encode python3 scripts/encode_kernel_variants.py $VARIANTS > $OUT/encncu.txt 2>&1; grep -E "^  vq_|Duration|Compute \(SM\)|Warp Cycles Per Issued|Registers Per|Achieved Occ|Issue Slots Busy" $OUT/encncu.txt ;;
  chunkncu) timeout 300 ncu --csv --metrics gpu__time_duration.sum python3 scripts/prefill_chunk_kernels.py --method ${METHOD:-turboquant_rvq} > $OUT/chunkncu.csv 2> $OUT/chunkncu.err; python3 scripts/prefill_chunk_kernels.py sum $OUT/chunkncu.csv; tail -3 $OUT/chunkncu.err ;;
  paired) for T in ${CONTEXTS:-8192 32768}; do timeout 280 python3 scripts/decode_model_cpu.py --shape llama-8b --context $T --steps 32 --rounds ${ROUNDS:-5} --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16; done > $OUT/paired.txt 2>&1; cat $OUT/paired.txt ;;
  kivitest) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_kivi_batch.py -k "kivi or tensor_core or take_the_kernels or fused" > $OUT/kivitest.txt 2>&1; grep -E "^FAILED|passed|failed|Error" $OUT/kivitest.txt | head -30 ;;
  steadyk) timeout 560 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --context ${CONTEXTS:-8192,32768,131072} --repeats ${REPEATS:-1} --decode-tokens 128 --baselines none --isolate --timeout 250 --json > $OUT/h200_bench_steady_kivi.json 2> $OUT/steadyk.err; tail -3 $OUT/steadyk.err; python3 scripts/bench_samples.py $OUT/h200_bench_steady_kivi.json ;;
  steadyp) timeout 560 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context ${CONTEXTS:-8192,32768} --repeats ${REPEATS:-4} --decode-tokens 128 --baselines none --warmup full --json $EXTRA > $OUT/h200_bench_paired.json 2> $OUT/steadyp.err; tail -3 $OUT/steadyp.err; python3 scripts/bench_samples.py $OUT/h200_bench_paired.json ;;
  kpaired) for T in ${CONTEXTS:-8192 32768 131072}; do R=${ROUNDS:-5}; [ $T -gt 65536 ] && R=3; timeout 400 python3 scripts/decode_model_cpu.py --shape llama-8b --context $T --steps 32 --rounds $R --method kivi:bit_width_inlier=4 $(for v in $VARIANTS; do echo "--method kivi:bit_width_inlier=4@$v"; done); done > $OUT/kpaired.txt 2>&1; grep -v Warn $OUT/kpaired.txt ;;
  wsync) (timeout 200 python3 scripts/prefill_host_device.py --context ${CONTEXTS:-8192,32768} --method waterfill --profile; for f in ${INFLIGHTS:-4 32}; do echo "== LAYERS_IN_FLIGHT=$f"; VELOXQUANT_PREFILL_LAYERS_IN_FLIGHT=$f timeout 100 python3 scripts/prefill_host_device.py --context 8192 --method waterfill; done) > $OUT/wsync.txt 2>&1; grep -v "^ *[0-9].*{built-in\|^$\|Warn" $OUT/wsync.txt | head -150 ;;
  wlayers) timeout 300 python3 scripts/prefill_layer_split.py --context ${CONTEXT:-8192} --set bit_width_inlier=4 --set residual_length=16 --passes 3 --profile 0 > $OUT/wlayers.txt 2>&1; grep -v "Warn\|^$" $OUT/wlayers.txt | head -80 ;;
  psplit) timeout 250 python3 scripts/prefill_host_device.py --context ${CONTEXTS:-8192,32768} > $OUT/psplit.txt 2>&1; grep -v "Warn\|^$" $OUT/psplit.txt ;;
  pbench) timeout 400 python3 -m veloxquant_mlx bench --shape llama-8b --random-weights --method kivi --set kivi:bit_width_inlier=4 --method waterfill --set waterfill:bit_width_inlier=4 --set waterfill:residual_length=16 --context ${CONTEXTS:-8192,32768} --repeats ${REPEATS:-3} --decode-tokens ${DECODE:-32} --baselines none --warmup full --json > $OUT/h200_bench_prefill.json 2> $OUT/pbench.err; tail -3 $OUT/pbench.err; python3 scripts/bench_samples.py $OUT/h200_bench_prefill.json ;;
  pin) lscpu | grep -iE "numa|socket|model name" > $OUT/pin.txt; nvidia-smi topo -m >> $OUT/pin.txt 2>&1; cat $OUT/pin.txt
    for cpus in ${PIN_SETS:-0-7 8-15}; do echo "== taskset -c $cpus"; CONTEXTS=${CONTEXTS:-32768} REPEATS=${REPEATS:-2} taskset -c $cpus bash $0 - steadyk | grep -v "^+" | grep -E "none|kivi"; cp $OUT/h200_bench_steady_kivi.json $OUT/pin_$cpus.json; done ;;
  graphs) for env in "X=0" "MLX_USE_CUDA_GRAPHS=0" "MLX_CUDA_GRAPH_CACHE_SIZE=4000" "MLX_MAX_OPS_PER_BUFFER=240" ${GRAPH_ENVS}; do echo "== $env"; env $env CONTEXTS=${CONTEXTS:-8192,32768} REPEATS=${REPEATS:-3} bash $0 - steadyk | grep -v "^+" | grep -E "none|kivi"; cp $OUT/h200_bench_steady_kivi.json "$OUT/graphs_${env%%=*}.json"; done ;;
  cstep) (for T in ${CONTEXTS:-8192 32768}; do timeout 200 python3 scripts/compiled_step_host.py --context $T --rounds ${ROUNDS:-3}; done) > $OUT/cstep.txt 2>&1; grep -v Warn $OUT/cstep.txt ;;
  tqsplit) (timeout 200 python3 scripts/prefill_host_device.py --context ${CONTEXTS:-8192} --method turboquant_rvq --profile; timeout 250 python3 scripts/prefill_layer_split.py --context ${CONTEXT:-8192} --method turboquant_rvq --passes 3 --profile 0) > $OUT/tqsplit.txt 2>&1; grep -v "^ *[0-9].*{built-in\|^$\|Warn" $OUT/tqsplit.txt | head -150 ;;
  tripaired) # the three quantizers' decode against the plain cache, paired rounds, caches filled directly (session 47)
    for T in ${CONTEXTS:-8192 32768 131072}; do R=${ROUNDS:-4}; [ $T -gt 65536 ] && R=${ROUNDS128:-3}
      timeout ${TMO:-200} python3 scripts/decode_model_cpu.py --shape llama-8b --context $T --steps 32 --rounds $R --burst \
        --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16 --method turboquant_rvq \
        > $OUT/paired_$T.txt 2>&1; grep -v "^  \.\.\|Warn" $OUT/paired_$T.txt; done ;;
  bktest) # the batch forms' CUDA kernels against their op paths (KIVI, waterfill, TurboQuant-RVQ; session 48), kivi_sink (s49)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_decode_kernels.py -k "batch or take_the_kernels or kivi_sink" > $OUT/bktest.txt 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" $OUT/bktest.txt | head -20 ;;
  gbatch) # batched decode of the three quantizers vs mlx_lm's BatchKVCache, llama-8b shape (scripts/batch_decode.py)
    timeout ${TMO:-500} python3 scripts/batch_decode.py --shape llama-8b --batch ${BATCH:-8} --context ${CONTEXT:-8192} \
      --steps 16 --repeats ${REPEATS:-3} --method kivi:bit_width_inlier=4 --method waterfill:bit_width_inlier=4,residual_length=16 \
      --method turboquant_rvq --out $OUT/gbatch_${BATCH:-8}x${CONTEXT:-8192}.json > $OUT/gbatch.txt 2>&1; grep -v Warn $OUT/gbatch.txt ;;
  onechunk) # a prompt in one chunk (mlx_lm prefills up to 2048 tokens so): every method, then the 4-bit caches at llama-8b's width
    (timeout 300 python3 scripts/prefill_peak.py --contexts ${CONTEXTS:-2047} --steps 2048 --methods all --warm;
     timeout 200 python3 scripts/prefill_peak.py --shape llama-8b --layers 8 --contexts 2047 --steps 2048 --warm --methods none,kivi:bit_width_inlier=4,waterfill:bit_width_inlier=4:residual_length=16,turboquant_rvq,h2o,snapkv,gear
    ) > $OUT/onechunk.txt 2>&1; grep -v Warn $OUT/onechunk.txt ;;
  policies) # one-chunk peaks under other device policies (scripts/device_policy_variants.py), SmolLM2 every method
    for p in ${POLICIES:-asis cpu}; do
      timeout 300 python3 scripts/device_policy_variants.py $p --contexts ${CONTEXTS:-2047} --steps 2048 --methods ${METHODS:-all} --warm > $OUT/policy_$p.txt 2>&1
      timeout 200 python3 scripts/device_policy_variants.py $p --shape llama-8b --layers 8 --contexts 2047,8192 --steps 2048 --warm --methods none,kivi:bit_width_inlier=4,waterfill:bit_width_inlier=4:residual_length=16,turboquant_rvq,h2o,snapkv,kvquant,streaming_llm,gear >> $OUT/policy_$p.txt 2>&1
      grep -v Warn $OUT/policy_$p.txt; done ;;
  vqk) # the nearest-codeword kernel (branch wip/vq-nearest-kernel): its tests, vecinfer's memory tests, and its time
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rxXfE tests/test_vq_methods.py tests/test_prefill_memory.py -k "vq or vecinfer or a2ats" > $OUT/vqk.txt 2>&1; tail -12 $OUT/vqk.txt
    for v in 1 0; do echo "== VELOXQUANT_DECODE_KERNELS=$v"; VELOXQUANT_DECODE_KERNELS=$v timeout 150 python3 scripts/prefill_peak.py --contexts 2047 --steps 2048 --methods none,vecinfer,a2ats --warm 2>&1 | grep -v Warn;
      VELOXQUANT_DECODE_KERNELS=$v timeout 150 python3 scripts/prefill_peak.py --shape llama-8b --layers 8 --contexts 8192 --steps 2048 --warm --methods none,vecinfer 2>&1 | grep -v Warn; done ;;
  pprof) # where the slow methods' GPU prefill goes: prefill_peak.py --profile (own time per Python function)
    timeout 280 python3 scripts/prefill_peak.py --shape llama-8b --layers 8 --contexts 8192 --steps 2048 --warm --profile ${TOP:-14} --methods ${METHODS:-none,gear,h2o,kvquant,streaming_llm} > $OUT/pprof.txt 2>&1; grep -v Warn $OUT/pprof.txt | cut -c1-160 ;;
  gearfit) # GEAR's fit piece by piece, and whole chunk calls (scripts/gear_fit_cost.py)
    timeout 200 python3 scripts/gear_fit_cost.py > $OUT/gearfit.txt 2>&1; grep -v Warn $OUT/gearfit.txt ;;
  gtest) # GEAR's fit kernel and GEAR's tests
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rxXfE tests/test_quant_mixed.py tests/test_lowrank.py > $OUT/gtest.txt 2>&1; tail -12 $OUT/gtest.txt ;;
  stream) # StreamingLLM's window tiles: its tests, and its prefill time and peak (llama-8b x 8, 8192 / 2048; SmolLM2 in one chunk)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_eviction_contract.py -k streaming > $OUT/stream.txt 2>&1; tail -3 $OUT/stream.txt
    timeout 150 python3 scripts/prefill_peak.py --shape llama-8b --layers 8 --contexts 8192 --steps 2048 --warm --methods none,streaming_llm,gear 2>&1 | grep -v Warn
    timeout 100 python3 scripts/prefill_peak.py --contexts 2047 --steps 2048 --warm --methods none,streaming_llm 2>&1 | grep -v Warn ;;
  vqfit) # vecinfer / A2ATS prefill after the k-means without per-iteration host waits
    timeout 100 python3 scripts/prefill_peak.py --contexts 2047 --steps 2048 --warm --methods none,vecinfer,a2ats 2>&1 | grep -v Warn
    timeout 100 python3 scripts/prefill_peak.py --shape llama-8b --layers 8 --contexts 8192 --steps 2048 --warm --methods none,vecinfer 2>&1 | grep -v Warn ;;
  kvqcost) # where KVQuant's later prefill chunks go (store / fetch / past rows / whole chunk vs plain), llama-8b's layer
    timeout 200 python3 scripts/prefill_chunk_cost.py --method kvquant --context 2048,6144 > $OUT/kvqcost.txt 2>&1; grep -v Warn $OUT/kvqcost.txt ;;
  kvqk) # KVQuant's prefill kernels: their tests, a layer-chunk's parts, and its prefill time and peak with the kernels and without
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_decode_kernels.py -k "kvquant" > $OUT/kvqk.txt 2>&1; grep -E "^E |passed|failed" $OUT/kvqk.txt | head -20
    timeout 60 python3 scripts/prefill_chunk_cost.py --method kvquant --context 2048,6144 2>&1 | grep -v Warn
    for v in 1 0; do echo "== VELOXQUANT_DECODE_KERNELS=$v"; VELOXQUANT_DECODE_KERNELS=$v timeout 80 python3 scripts/prefill_peak.py --shape llama-8b --layers 8 --contexts 8192 --steps 2048 --warm --methods none,kvquant,none,kvquant 2>&1 | grep -v Warn
      VELOXQUANT_DECODE_KERNELS=$v timeout 60 python3 scripts/prefill_peak.py --contexts 2047 --steps 2048 --warm --methods none,kvquant 2>&1 | grep -v Warn; done ;;
  alldec) # every mlx_lm method at its defaults, caches filled by a prefill through the model (decode_model_cpu.py --all)
    timeout ${ALLDEC_TIMEOUT:-400} python3 scripts/decode_model_cpu.py --shape ${SHAPE:-smollm2} --context ${CONTEXT:-8192} --steps ${STEPS:-16} --rounds ${ROUNDS:-2} --prefill --all > $OUT/alldec.txt 2>&1; grep -v "Warn\|rounds:\|warn\|self._check\|^  \.\." $OUT/alldec.txt ;;
  vdec) # GPU decode of the quantizers beside KIVI (each cache filled directly, then --steps pipelined steps; per-round ratio)
    timeout ${VDEC_TIMEOUT:-250} python3 scripts/decode_model_cpu.py --shape ${SHAPE:-smollm2} --context ${CONTEXT:-8192} --steps ${STEPS:-16} --rounds ${ROUNDS:-2} $(for m in ${METHODS:-kivi:bit_width_inlier=4 gear kivi_sink skvq kitty age_tiered cachegen zipcache kvquant vecinfer palu xkv xquant}; do echo "--method $m"; done) > $OUT/vdec.txt 2>&1; grep -v Warn $OUT/vdec.txt ;;
  timeline) # a decode step's device time by kernel (Nsight Compute over STEPS_NCU pipelined steps; one cache a process), all in timeline.txt
    for T in ${CONTEXTS:-131072}; do for m in ${METHODS:-none kivi:bit_width_inlier=4 waterfill:bit_width_inlier=4,residual_length=16}; do
      M=""; [ "$m" != none ] && M="--method $m"; echo "== $m $T" >> $OUT/timeline.txt
      timeout ${TL_TIMEOUT:-150} ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv python3 scripts/decode_timeline.py --context $T --steps ${STEPS_NCU:-2} $M > /tmp/tl.csv 2> /tmp/tl.err
      python3 scripts/decode_timeline.py --ncu-csv /tmp/tl.csv --steps ${STEPS_NCU:-2} 2>&1 | head -${TL_ROWS:-16} >> $OUT/timeline.txt
    done; done; cat $OUT/timeline.txt ;;
  suite) # the whole test suite in SHARDS parallel pytest processes (one GPU shared), each under SHARD_TIMEOUT (540) s; FILES narrows it
    files=(${FILES:-tests/test_*.py}); n=${SHARDS:-6}
    for k in $(seq 0 $((n - 1))); do
      sel=(); for i in "${!files[@]}"; do [ $((i % n)) -eq $k ] && sel+=("${files[$i]}"); done
      timeout ${SHARD_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -rfE "${sel[@]}" > $OUT/suite_$k.txt 2>&1 &
    done; wait
    grep -hE "^(FAILED|ERROR)|passed|failed|Timeout|Fatal|core dumped" $OUT/suite_*.txt | head -80 ;;
  esac
done
