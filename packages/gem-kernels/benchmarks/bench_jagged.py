"""Jagged helpers on the H200 against plain PyTorch indexing and the HBM copy rate.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/bench_jagged.py

Shape: B=1152 sequences, lengths uniform in [800, 2000] (70% of the padded batch valid), features
F = H*D = 512, bf16. Bytes counted: jagged_to_padded reads the valid rows and writes the whole padded
tensor (padding included); padded_to_jagged reads the valid rows of the padded tensor and writes the
jagged one; concat/split read and write every row once; mean reads every row; last-k reads and writes
B*k rows. The plain-indexing baselines get their token indices precomputed (not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from gem_kernels import (
    jagged_concat,
    jagged_last_k,
    jagged_mean,
    jagged_split,
    jagged_to_padded,
    padded_to_jagged,
    use_backend,
)

ROWS: list[dict] = []


def timeit(fn, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on the GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def record(case: str, ms: float, nbytes: float, copy_tbs: float | None) -> None:
    tbs = nbytes / ms / 1e9
    pct = 100 * tbs / copy_tbs if copy_tbs else float("nan")
    ROWS.append({"case": case, "ms": ms, "TB/s": tbs, "%copy": pct})
    print(f"{case:52s} {ms:9.3f} ms {tbs:6.2f} TB/s ({pct:4.0f}% copy)", flush=True)


def copy_rate(device: str, iters: int) -> tuple[float, int]:
    """Milliseconds and bytes (read + written) of a large device-to-device copy."""
    x = torch.empty(ARGS.copy_mib * 2**20 // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    return timeit(lambda: y.copy_(x), iters), 2 * x.numel() * 2


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    iters = ARGS.iters
    ms, copy_bytes = copy_rate(device, iters)
    copy_tbs = copy_bytes / ms / 1e9
    record("HBM copy (read+write)", ms, copy_bytes, None)

    g = torch.Generator().manual_seed(0)
    batch, max_len, feat = ARGS.batch, ARGS.max_len, ARGS.feat
    low = round(max_len * (2 * ARGS.valid - 1))
    lengths = torch.randint(low, max_len + 1, (batch,), generator=g)
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    total = int(offsets[-1])
    offsets = offsets.to(device)
    values = torch.randn(total, feat, generator=g).to(device, torch.bfloat16)
    row = feat * 2
    seg = torch.repeat_interleave(torch.arange(batch, device=device), lengths.to(device))
    pos = torch.arange(total, device=device) - offsets[seg]
    print(f"tokens {total} ({total / (batch * max_len):.1%} of padded), F={feat} bf16")

    def plain_j2p():
        out = values.new_zeros(batch, max_len, feat)
        out[seg, pos] = values
        return out

    padded = plain_j2p()
    j2p_bytes = (total + batch * max_len) * row
    p2j_bytes = 2 * total * row
    for backend in ("triton", "reference"):
        with use_backend(backend):
            got = jagged_to_padded(values, offsets, max_len)
            back = padded_to_jagged(padded, offsets, total)
            assert torch.equal(got, padded) and torch.equal(back, values), backend
            t = timeit(lambda: jagged_to_padded(values, offsets, max_len), iters)
            record(f"jagged_to_padded [{backend}]", t, j2p_bytes, copy_tbs)
            t = timeit(lambda: padded_to_jagged(padded, offsets, total), iters)
            record(f"padded_to_jagged [{backend}]", t, p2j_bytes, copy_tbs)
    record(
        "jagged_to_padded [plain indexing: zeros + index_put]", timeit(plain_j2p, iters), j2p_bytes, copy_tbs
    )
    record("padded_to_jagged [plain indexing: padded[seg, pos]]", timeit(lambda: padded[seg, pos], iters),
           p2j_bytes, copy_tbs)  # fmt: skip

    # Prepend 4 summary tokens to every history, split them off again, pool.
    k_sum = 4
    summary = torch.randn(batch * k_sum, feat, generator=g).to(device, torch.bfloat16)
    s_off = torch.arange(0, batch * k_sum + 1, k_sum, device=device)
    both, both_off = jagged_concat(summary, s_off, values, offsets)
    all_bytes = 2 * both.shape[0] * row
    t = timeit(lambda: jagged_concat(summary, s_off, values, offsets), iters)
    record("jagged_concat (4 summary tokens + history)", t, all_bytes, copy_tbs)
    t = timeit(lambda: jagged_split(both, both_off, s_off, offsets, a_total=batch * k_sum), iters)
    record("jagged_split", t, all_bytes, copy_tbs)
    t = timeit(lambda: jagged_mean(values, offsets), iters)
    record("jagged_mean", t, total * row + batch * row, copy_tbs)
    t = timeit(lambda: jagged_last_k(values, offsets, 64), iters)
    record("jagged_last_k k=64", t, 2 * batch * 64 * row, copy_tbs)

    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump({"rows": ROWS, "copy_TBs": copy_tbs, "tokens": total, "args": vars(ARGS)}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1152)
    parser.add_argument("--max-len", type=int, default=2000)
    parser.add_argument("--valid", type=float, default=0.7)
    parser.add_argument("--feat", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--copy-mib", type=int, default=4096)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_jagged.json"))
    ARGS = parser.parse_args()
    if ARGS.small:
        ARGS.batch, ARGS.max_len, ARGS.feat, ARGS.iters, ARGS.copy_mib = 3, 70, 8, 1, 1
    main()
