#!/usr/bin/env bash
# GPU correctness pass on a CUDA machine: every `gpu`-marked test of every package, the gem-precision
# Triton checks at large shapes, and a short real gem-train run (train, resume, eval) on the GPU.
#
# Usage (repository root, CUDA machine; torch and triton installed; torchrec optional, as wheels):
#   bash tools/gpu_check.sh [LOG_DIR]
# If ./.whl/ holds wheels (torchrec and its CPU fbgemm for machines without them), they are installed
# into a private target directory with --no-deps and put on PYTHONPATH.
set -uo pipefail
LOG_DIR=${1:-gpu-check-logs}
mkdir -p "$LOG_DIR"
SITE=""
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=/tmp/gem-site
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl > "$LOG_DIR/pip.log" 2>&1
fi
export PYTHONPATH="${SITE:+$SITE:}$(ls -d packages/*/src | tr '\n' ':')"
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME COMMAND...: run, log, record failure, print one summary line
  local name=$1; shift
  local t0=$SECONDS
  if "$@" > "$LOG_DIR/$name.log" 2>&1; then r=ok; else r=FAIL; status=1; fi
  printf '%-28s %-4s %4ss  %s\n' "$name" "$r" "$((SECONDS - t0))" "$(tail -n 1 "$LOG_DIR/$name.log")"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step pytest-gpu python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --import-mode=importlib \
  --timeout=900 packages/gem-kernels/tests packages/gem-precision/tests packages/gem-model/tests
step precision-triton-big python3 packages/gem-precision/tests/_triton_interpret_checks.py --big
RUN=$LOG_DIR/train-run
step train-cuda python3 -m gem_train.cli train --config base-h200 run.out_dir="$RUN" train.steps=60 \
  train.log_every=20 train.eval_every=30 train.eval_batches=2 checkpoint.every=30 data.num_workers=2 \
  data.synthetic.eval_examples=4096 train.valid_every=30 train.valid_batches=2
step train-resume python3 -m gem_train.cli train --resume "$(ls -d "$RUN"/* | head -n 1)" train.steps=80
step eval-cuda python3 -m gem_train.cli eval --checkpoint "$(ls -d "$RUN"/* | head -n 1)" --batches 2
exit $status
