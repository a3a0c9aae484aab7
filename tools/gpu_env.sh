# Sourced by the device scripts (tools/gpu_*.sh) from the repository root: torchrec and its companions from the
# wheels in ./.whl installed once per machine into /tmp/gem-site (the device has no CUDA TorchRec), the
# packages' sources on PYTHONPATH, the device and versions printed into "$OUT/device.txt" ($OUT must be set).
SITE=/tmp/gem-site
if [[ ! -d $SITE ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl > "$OUT/pip.log" 2>&1
fi
export PYTHONPATH="$SITE:$(ls -d packages/*/src | tr '\n' ':')"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
