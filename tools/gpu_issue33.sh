#!/usr/bin/env bash
# Issue 33 on one GPU, one call: the gem-precision and gem-model `gpu` tests, then `gem-train bench --config
# base-h200` of the code before the redesign (1aceeea) and of this tree, on the same machine; then issue 37's
# base part with the time left. Stage first, on a machine with the git history (the device copy has none):
#   mkdir -p .gpu/base && git archive 1aceeea packages | tar -x -C .gpu/base
# and torchrec's wheels in .whl/ (as tools/gpu_check.sh takes them); run with both carried:
#   BENCH_T=150 DEADLINE=585 bash tools/gpu_issue33.sh      ($OUT: where the logs and JSON go)
set -u
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 GEM_COMPILE_CACHE=/tmp/gemcc GEM_KERNELS_CACHE=/tmp/gemkc GEM_KERNELS_TUNE_CANDIDATES=1
NEW=$(ls -d packages/*/src | tr '\n' ':'); OLD=$(ls -d .gpu/base/packages/*/src | tr '\n' ':')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=/tmp/site:$NEW timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu -o addopts="" --import-mode=importlib \
  --timeout=180 packages/gem-precision/tests packages/gem-model/tests 2>&1 | tee $OUT/gpu_tests_rest.log | grep -E "PASS|FAIL|ERROR|passed|failed|Timeout" | cut -c1-160
echo "tests done at $((SECONDS-T0))s"
for r in old new; do
  P=$([ $r = old ] && echo $OLD || echo $NEW); t0=$SECONDS
  PYTHONPATH=/tmp/site:$P timeout ${BENCH_T:-170} python3 -m gem_train.cli bench --config base-h200 --steps 40 --warmup 10 --json \
    > $OUT/bench_$r.json 2> $OUT/bench_$r.err
  echo "$r rc=$? $((SECONDS-t0))s $(python3 -c "import json; d=json.load(open('$OUT/bench_$r.json')); print(round(d['step_time_ms_mean'],2), 'ms mean', round(d['step_time_ms_median'],2), 'median', round(d.get('mfu') or 0,4), 'mfu', round(d.get('peak_memory_gib',0),2),'GiB')" 2>&1 | tail -1)"
done
LEFT=$((${DEADLINE:-585} - (SECONDS - T0)))
echo "issue 37 base with ${LEFT}s"
if [ $LEFT -gt 150 ]; then
  mkdir -p $OUT/i37
  PYTHONPATH=/tmp/site:$NEW timeout $LEFT python3 packages/gem-train/benchmarks/bench_speed.py --config base-h200 \
    --recipes fp8_rowwise,bf16 --steps 10 --distinct 3 --prefetch-steps 0 --profile-steps 0 --cuda-graphs bf16 \
    --out $OUT/i37/base > $OUT/i37/base.log 2>&1; echo "base rc=$?"; tail -25 $OUT/i37/base.log | cut -c1-200
fi
echo "total $((SECONDS-T0))s"
