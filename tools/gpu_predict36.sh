#!/usr/bin/env bash
# Issue 36 on one H100/H200: the inference-mode GPU tests, then `gem-train predict` throughput with base-h200
# (a 2-step checkpoint unless CKPT names one: weights do not change the speed), eager and --compile
# (GEM36_PREDICT_MODES picks; "serial" is eager with no forward kept in flight, predict's CUDA path before the
# pipelining: forwards_in_flight patched to 0). GEM36_TESTS=0 skips the tests.
# Usage (repository root): bash tools/gpu_predict36.sh OUT [ROWS] [CKPT]
set -uo pipefail
OUT=${1:?usage: bash tools/gpu_predict36.sh OUT [ROWS] [CKPT]}
ROWS=${2:-262144}
CK=${3:-}
mkdir -p "$OUT"
source tools/gpu_env.sh
export GEM_COMPILE_CACHE=${GEM_COMPILE_CACHE:-/tmp/gem36-compile-cache}
export GEM_KERNELS_TUNE_CANDIDATES=${GEM_KERNELS_TUNE_CANDIDATES:-1}  # one attention tile per bucket (cold)
if [[ ${GEM36_TESTS:-1} == 1 ]]; then
  timeout 150 python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  packages/gem-model/tests/test_gem_model_gpu.py packages/gem-kernels/tests/test_attention_schedule.py \
  packages/gem-train/tests/test_transfer_predict.py -k "cuda or in_flight" \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$? $(tail -n 1 "$OUT/tests.log")"
fi
if [[ -z $CK ]]; then
  timeout 150 python3 -m gem_train.cli train --config base-h200 train.steps=2 train.compile=false \
    run.out_dir=/tmp/ck36 train.progress_bar=false train.eval_every=0 checkpoint.every=0 \
    data.synthetic.eval_examples=2048 > "$OUT/train.log" 2>&1; echo "train rc=$?"
  CK=$(ls -d /tmp/ck36/*/checkpoints/step_* | tail -n 1)
fi
SERIAL='import sys, gem_train.transfer.predict as p; p.forwards_in_flight = lambda d: 0
from gem_train.cli.main import main; sys.exit(main())'
for mode in ${GEM36_PREDICT_MODES:-eager compile}; do  # compile: predict --compile
  extra=""; [[ $mode == compile ]] && extra=--compile
  cli=(-m gem_train.cli); [[ $mode == serial ]] && cli=(-c "$SERIAL")
  rm -rf /tmp/pred36
  echo "== $mode" >> "$OUT/predict.log"
  timeout "${GEM36_PREDICT_S:-200}" python3 "${cli[@]}" predict --checkpoint "$CK" --out /tmp/pred36 --split test --no-progress \
    $extra "data.synthetic.eval_examples=$ROWS" >> "$OUT/predict.log" 2>&1
  echo "predict $mode rc=$? $(grep -E 'examples/s' "$OUT/predict.log" | tail -n 1 | grep -o 'test .*')"
done
