#!/usr/bin/env bash
# Build each package's wheel on its own, then install the gem-kernels wheel alone into a fresh
# environment with only its declared dependencies (resolved against the lock's versions) and import it.
set -euo pipefail
cd "$(dirname "$0")/.."
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
for pkg in gem-kernels gem-precision gem-parallel gem-model gem-train; do
  uv build --quiet --package "$pkg" --wheel --out-dir "$dist"
done
ls "$dist"
# The lock's versions as constraints, so the fresh environment reuses the cached torch.
uv export --quiet --frozen --no-hashes --no-emit-workspace --group dev --group cpu --no-annotate \
  | grep -v '^fbgemm-gpu==' > "$dist/constraints.txt"
uv venv --quiet "$dist/venv"
VIRTUAL_ENV="$dist/venv" uv pip install --quiet -c "$dist/constraints.txt" "$dist"/gem_kernels-*.whl
"$dist/venv/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util

import gem_kernels

installed = sorted(d.metadata["Name"].lower() for d in md.distributions())
print("gem_kernels", gem_kernels.__version__, "installed alone with:", len(installed), "distributions")
for forbidden in ("torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "gem-model", "gem-train", "gem-parallel"):
    assert forbidden not in installed, f"{forbidden} was pulled in by the gem-kernels wheel"
assert importlib.util.find_spec("torchrec") is None
PY
