#!/usr/bin/env bash
# Issue 37's GPU tests and measurements in one call on one H100/H200 (torch + triton installed; torchrec as
# wheels in ./.whl, as tools/gpu_check.sh takes them). Each part writes its log and JSON under OUT_DIR/PART/;
# a compact summary of all of them is printed at the end (tools/gpu_issue37_summary.py).
#
# Usage (repository root):  bash tools/gpu_issue37.sh OUT_DIR [PARTS]
#   PARTS (comma-separated, in this order by default):
#     tests      GPU tests of the new paths: packed-row kernels at a GEM trunk's shapes (bit-exact against the
#                old quantizer), fp8_rowwise GPU tests (the op changed: per-call roofline, cached weight casts)
#     allgather  the 8-bit all-gather quantizer per round: fused vs old vs the bf16 cast (target <= 2x), sweep
#     fp8layers  device rates and every GEMM of base-h200 / large-h200 in bf16 and FP8 against the roofline
#     wsprobe    does this Triton's Hopper warp specialization take on the backward's loop shapes (compile only)
#     base       bench_speed base-h200: bf16 vs fp8_rowwise (auto), compiled, cold caches; + CUDA graphs
#     large      bench_speed large-h200: bf16 vs fp8_rowwise (auto), compiled, cold caches; MFU, memory
#     ffnsweep   the fused SwiGLU backward's tiles at base/large shapes (its best base tiles go to ffn_on)
#     ffnbench   the SwiGLU FFN at base/large widths: fused backward vs the composition (eager, compiled,
#                max-autotune), with a sweep of the fused kernel's tiles
#     ffn        bench_speed base-h200 bf16 with the SwiGLU composition (ffn_off) and the fused one (ffn_on),
#                profiled: the step's kernel time by kind before and after
#     largeffn   the same on large-h200 (large_ffn_off, large_ffn_on)
# Parts that cannot finish before GEM37_DEADLINE_S (default 470 s after the start) are skipped and say so:
# with cold caches `base` takes ~4 min, `large` ~4-5 min, so run `large` as a second call if it is skipped:
#   bash tools/gpu_issue37.sh OUT_DIR2 large
set -uo pipefail
OUT=${1:?usage: bash tools/gpu_issue37.sh OUT_DIR [PARTS]}
PARTS=${2:-tests,allgather,fp8layers,wsprobe,base,large}
DEADLINE=${GEM37_DEADLINE_S:-470}
START=$SECONDS
mkdir -p "$OUT"
source tools/gpu_env.sh  # wheels, PYTHONPATH, the device line in $OUT/device.txt
export GEM_KERNELS_TUNE_CANDIDATES=${GEM_KERNELS_TUNE_CANDIDATES:-1}  # one attention tile per bucket (cold)
export GEM_COMPILE_CACHE=${GEM_COMPILE_CACHE:-/tmp/gem37-compile-cache}  # not under OUT (large)

status=0
# part NAME NEEDS_S COMMAND...: run if NEEDS_S seconds are left before the deadline (else skip), under a
# timeout of what is left; its output in OUT/NAME/log.txt, its last line printed.
part() {
  local name=$1 needs=$2; shift 2
  [[ ",$PARTS," == *",$name,"* ]] || return 0
  local left=$((DEADLINE - (SECONDS - START)))
  if (( left < needs )); then
    printf '%-10s SKIPPED (%ss left, needs ~%ss): run it alone: bash tools/gpu_issue37.sh DIR %s\n' \
      "$name" "$left" "$needs" "$name"
    return 0
  fi
  mkdir -p "$OUT/$name"
  local t0=$SECONDS r=ok
  timeout "$left" "$@" > "$OUT/$name/log.txt" 2>&1 || { r=FAIL; status=1; }
  printf '%-10s %-4s %4ss  %s\n' "$name" "$r" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name/log.txt" | cut -c1-150)"
}

part tests 60 bash -c "python3 packages/gem-precision/tests/_triton_packed_checks.py --big && \
  python3 -m pytest -q -p no:cacheprovider -o addopts='' --import-mode=importlib -m gpu --timeout=300 \
  packages/gem-precision/tests/test_packed.py packages/gem-precision/tests/test_rowwise_fallback.py \
  packages/gem-precision/tests/test_fp8_auto.py packages/gem-kernels/tests/test_swiglu_gpu.py"
part allgather 60 python3 packages/gem-train/benchmarks/bench_all_gather_quant.py --config base --sweep \
  --out "$OUT/allgather"
part fp8layers 90 python3 packages/gem-precision/benchmarks/bench_fp8_layers.py --out "$OUT/fp8layers"
part wsprobe 30 python3 packages/gem-kernels/benchmarks/ws_probe_sm90.py
# fp8_rowwise first: the CUDA-graph measurement (bf16, last) cannot disturb it if a capture fails.
part base 240 python3 packages/gem-train/benchmarks/bench_speed.py --config base-h200 --recipes fp8_rowwise,bf16 \
  --steps 10 --distinct 3 --prefetch-steps 0 --profile-steps 3 --cuda-graphs bf16 --out "$OUT/base"
part large 240 python3 packages/gem-train/benchmarks/bench_speed.py --config large-h200 --recipes bf16,fp8_rowwise \
  --steps 6 --distinct 2 --prefetch-steps 0 --profile-steps 0 --out "$OUT/large"
# the fused kernel's tiles at both trunks' shapes; ffn_on then runs the best one found for base
part ffnsweep 60 python3 packages/gem-kernels/benchmarks/bench_swiglu.py --sweep --steps-only \
  --out "$OUT/ffnsweep/swiglu.json"
best=$(grep -s "^best base " "$OUT/ffnsweep/log.txt" | awk '{print $3}')
[[ -n "$best" ]] && export GEM_KERNELS_SWIGLU_BLOCKS=$best && echo "fused SwiGLU tiles: $best"
# ffn_pair PART PREFIX CONFIG STEPS DISTINCT PROFILE: bench_speed bf16 with the SwiGLU composition (PREFIX_off)
# and the fused kernel (PREFIX_on), when PART was asked for.
ffn_pair() {
  local want=$1 prefix=$2 config=$3 steps=$4 distinct=$5 prof=$6 fused name
  for fused in false true; do
    name=${prefix}_$([[ $fused == true ]] && echo on || echo off)
    [[ ",$PARTS," == *",$want,"* ]] && PARTS="$PARTS,$name"
    part "$name" 150 python3 packages/gem-train/benchmarks/bench_speed.py --config "$config" --recipes bf16 \
      --steps "$steps" --distinct "$distinct" --prefetch-steps 0 --profile-steps "$prof" \
      --set "model.overrides.fused_ffn=$fused" --out "$OUT/$name"
  done
}
ffn_pair ffn ffn base-h200 10 3 3
ffn_pair largeffn large_ffn large-h200 8 2 2
# last: it takes what is left (inductor's max-autotune compiles slowly)
part ffnbench 90 python3 packages/gem-kernels/benchmarks/bench_swiglu.py --sweep --autotune \
  --out "$OUT/ffnbench/swiglu.json"

python3 tools/gpu_issue37_summary.py "$OUT" | tee "$OUT/summary.txt"
echo "total $((SECONDS - START)) s"
exit $status
