#!/usr/bin/env bash
# Export Meta's open Triton GDPA forward (facebookresearch/ads_model_kernel_library, gdpa/triton + gdpa/utils)
# from a local bare mirror (the `fetch` tool's snapshot) into DEST (default .gpu/meta_gdpa/ at the repository
# root, a git-ignored folder) as the package tree its imports expect:
#   ads_mkl.ops.oss.gdpa.triton.{triton_generalized_dot_product_attention,math,hardware,register_helpers,
#                                vararg_kernel}
#   ads_mkl.ops.oss.gdpa.utils.{tma_utils,utils}
# (the kernel imports `ads_mkl.ops.oss.gdpa.triton.vararg_kernel` and math.py `ads_mkl.ops.oss.gdpa.triton.hardware`
# absolutely, the rest relatively). .gpu/ is git-ignored: Meta's code is never committed, only read at run time
# (python packages/gem-kernels/benchmarks/bench_meta_gdpa.py --meta-root .gpu/meta_gdpa).
#
#   bash packages/gem-kernels/benchmarks/stage_meta_gdpa.sh [MIRROR] [DEST]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MIRROR=${1:-/work/.mirror/facebookresearch+ads_model_kernel_library/repo}
DEST=${2:-$HERE/../../../.gpu/meta_gdpa}
REV=${META_GDPA_REV:-HEAD}
PKG=$DEST/ads_mkl/ops/oss/gdpa

rm -rf "$DEST"
mkdir -p "$PKG/triton" "$PKG/utils"
for d in ads_mkl ads_mkl/ops ads_mkl/ops/oss ads_mkl/ops/oss/gdpa ads_mkl/ops/oss/gdpa/triton ads_mkl/ops/oss/gdpa/utils; do
    : > "$DEST/$d/__init__.py"
done
for f in triton_generalized_dot_product_attention math hardware register_helpers vararg_kernel; do
    git -C "$MIRROR" show "$REV:gdpa/triton/$f.py" > "$PKG/triton/$f.py"
done
for f in tma_utils utils; do
    git -C "$MIRROR" show "$REV:gdpa/utils/$f.py" > "$PKG/utils/$f.py"
done
{
    echo "repository: facebookresearch/ads_model_kernel_library"
    echo "commit: $(git -C "$MIRROR" rev-parse "$REV")"
    echo "subject: $(git -C "$MIRROR" log -1 --format=%s "$REV")"
    echo "license: Apache-2.0 (see the headers of the files)"
} > "$DEST/SOURCE.txt"
echo "staged $(find "$DEST" -name '*.py' | wc -l) files at $DEST ($(head -2 "$DEST/SOURCE.txt" | tail -1))"
