#!/usr/bin/env bash
# Issue 35's base-h200 quality run (15 minutes of training on one GPU, model selected on validation) and issue
# 36's predict throughput on the GPU, in two chained device calls on one warm H100/H200 (the run directory
# under runs/ stays between calls while the machine is held; torchrec as wheels in ./.whl, as in
# tools/gpu_issue37.sh).
#
# Usage (repository root):
#   bash tools/gpu_issue35_36.sh OUT train  SECONDS   # train base-h200 for SECONDS, then SIGTERM: the trainer
#                                                     # stops after its step and checkpoints
#   bash tools/gpu_issue35_36.sh OUT resume SECONDS   # resume the newest run to STEPS (below), test the best-
#                                                     # validation checkpoint, then time predict on the test split
# Issue 36's GPU predict and CUDA tests on this run's newest checkpoint, in the same call after `train`:
#   bash tools/gpu_predict36.sh OUT 262144 "$(ls -d runs/q35/*/checkpoints/step_* | tail -n 1)"
# STEPS (GEM35_STEPS, default 6500; the H100 ran ~165 ms a step with validation) and the validation settings
# are the same in both; GEM35_EXTRA adds settings to both.
# Each call copies the run's metrics.jsonl / eval.json and its logs to OUT.
set -uo pipefail
OUT=${1:?usage: bash tools/gpu_issue35_36.sh OUT train|resume SECONDS}
PHASE=${2:?train or resume}
SECS=${3:?seconds}
STEPS=${GEM35_STEPS:-6500}
mkdir -p "$OUT"
source tools/gpu_env.sh
export GEM_COMPILE_CACHE=${GEM_COMPILE_CACHE:-/tmp/gem35-compile-cache}
ARGS=(--config base-h200 "train.steps=$STEPS" train.valid_every=1000 data.synthetic.valid_examples=32768
      checkpoint.every=1000 run.out_dir=runs/q35 train.progress_bar=false train.log_every=250)
# More settings for both calls (the same in each: a resume refuses a change of meaning), e.g. the synthetic levers.
read -r -a EXTRA <<< "${GEM35_EXTRA:-}"
ARGS+=("${EXTRA[@]}")
status=0
case $PHASE in
  train)
    # SIGTERM to python itself (no wrapper in between): one signal = stop after the step and checkpoint.
    timeout -s TERM "$SECS" python3 -m gem_train.cli train "${ARGS[@]}" > "$OUT/train.log" 2>&1 || status=$?
    ;;
  resume)
    timeout -s TERM "$SECS" python3 -m gem_train.cli train --resume latest "${ARGS[@]}" > "$OUT/train.log" 2>&1 \
      || status=$?
    RUN=$(ls -d runs/q35/*/ | tail -n 1)
    if [[ -d $RUN/checkpoints/best ]]; then
      for extra in ${GEM35_PREDICT_EXTRA:-""}; do
        rm -rf /tmp/pred35
        timeout ${GEM35_PREDICT_S:-240} python3 -m gem_train.cli predict --checkpoint "$RUN/checkpoints/best" --out /tmp/pred35 \
          --split test --no-progress $extra data.synthetic.eval_examples=262144 \
          >> "$OUT/predict.log" 2>&1 || echo "predict $extra failed: $?" >> "$OUT/predict.log"
      done
    fi
    ;;
esac
RUN=$(ls -d runs/q35/*/ 2>/dev/null | tail -n 1)
if [[ -n $RUN ]]; then
  cp "$RUN"/metrics.jsonl "$RUN"/eval.json "$OUT"/ 2>/dev/null
  ls "$RUN/checkpoints" > "$OUT/checkpoints.txt" 2>/dev/null
fi
echo "exit $status"
tail -n 12 "$OUT/train.log"
[[ -f $OUT/predict.log ]] && grep -E "examples/s|failed" "$OUT/predict.log"
exit 0
