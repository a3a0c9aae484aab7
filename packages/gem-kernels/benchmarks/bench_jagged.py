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

import torch
from common import add_batch_args, add_run_args, copy_rate, timeit, uniform_lengths, write_results

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


def record(case: str, ms: float, nbytes: float, copy_tbs: float | None) -> None:
    tbs = nbytes / ms / 1e9
    pct = 100 * tbs / copy_tbs if copy_tbs else float("nan")
    ROWS.append({"case": case, "ms": ms, "TB/s": tbs, "%copy": pct})
    print(f"{case:52s} {ms:9.3f} ms {tbs:6.2f} TB/s ({pct:4.0f}% copy)", flush=True)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    iters = ARGS.iters
    ms, copy_bytes = copy_rate(device, ARGS.copy_mib * 2**20 // 2, lambda fn: timeit(fn, iters))
    copy_tbs = copy_bytes / ms / 1e9
    record("HBM copy (read+write)", ms, copy_bytes, None)

    g = torch.Generator().manual_seed(0)
    batch, max_len, feat = ARGS.batch, ARGS.max_len, ARGS.feat
    lengths, offsets = uniform_lengths(batch, max_len, ARGS.valid, g, torch.int64)
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

    write_results(ARGS.out, ROWS, copy_tbs, total, ARGS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_batch_args(parser)
    parser.add_argument("--feat", type=int, default=512)
    add_run_args(parser, "bench_jagged.json")
    ARGS = parser.parse_args()
    if ARGS.small:
        ARGS.batch, ARGS.max_len, ARGS.feat, ARGS.iters, ARGS.copy_mib = 3, 70, 8, 1, 1
    main()
