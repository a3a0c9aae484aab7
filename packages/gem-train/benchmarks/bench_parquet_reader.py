"""Examples/s and peak memory of the Parquet reader (gem_train.data.parquet) on base-h200-like rows.

Rows: 32 dense floats (one fixed-size list column), 8 sparse features (6 single ids, 2 multi-hot lists of
1-4 ids), one history of item ids, action ids and timestamps with log-normal lengths like base-h200's
synthetic data (mu 5.5, sigma 1: median 245, clipped to 1024; 3% empty), a click label and a nullable
conversion label. Written once to --data (row groups of --row-group rows), then read:

- one worker: the reader's stream in this process (read + decode + check + shuffle + convert + GemBatch);
- N workers: ``make_train_loader(num_workers=N)``, what the trainer does (adds the workers' IPC);
- peak memory: for each shuffle buffer, a fresh process reads --mem-batches batches and reports its peak RSS
  above the RSS before it (after a warm-up batch), and the Arrow pool's peak.

    python packages/gem-train/benchmarks/bench_parquet_reader.py --out DIR [--rows 32768] [--workers 4]

Prints a table and writes DIR/bench_parquet_reader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

N_DENSE, N_SINGLE, N_MULTI, MAX_LEN = 32, 6, 2, 1024


def write_data(path: Path, rows: int, row_group: int, seed: int = 0) -> None:
    """The benchmark table (see the module docstring), written chunk by chunk."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    for lo in range(0, rows, row_group):
        n = min(row_group, rows - lo)
        lengths = np.clip(np.floor(rng.lognormal(5.5, 1.0, n)), 0, MAX_LEN).astype(np.int64)
        lengths[rng.uniform(size=n) < 0.03] = 0
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        total = int(offsets[-1])
        # Non-decreasing timestamps within each row: a running sum of positive gaps (rows need not restart).
        ts = 1_700_000_000 + np.cumsum(rng.integers(1, 3600, total))

        def lst(values: np.ndarray, off: np.ndarray = offsets) -> pa.Array:
            return pa.ListArray.from_arrays(pa.array(off), pa.array(values, pa.int64()))

        cols: dict[str, pa.Array] = {
            "dense": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.normal(size=n * N_DENSE).astype(np.float32)), N_DENSE
            ),
            "items": lst(rng.integers(0, 200_000, total)),
            "actions": lst(rng.integers(0, 4, total)),
            "timestamps": lst(ts),
            "click": pa.array(rng.integers(0, 2, n), pa.int8()),
            "conversion": pa.array(rng.integers(0, 2, n), pa.int8(), mask=rng.uniform(size=n) < 0.9),
        }
        for k in range(N_SINGLE):
            cols[f"s{k}"] = pa.array(rng.integers(0, 100_000, n), pa.int64())
        for k in range(N_MULTI):
            m = rng.integers(1, 5, n)
            cols[f"m{k}"] = lst(
                rng.integers(0, 1000, int(m.sum())), np.concatenate([[0], np.cumsum(m)]).astype(np.int32)
            )
        table = pa.table(cols)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=row_group)
    assert writer is not None
    writer.close()


def section(root: Path, buffer: int) -> dict:
    sparse = {f"s{k}": {"num_embeddings": 100_000} for k in range(N_SINGLE)}
    sparse.update({f"m{k}": {"num_embeddings": 1000, "max_ids": 4} for k in range(N_MULTI)})
    return {
        "root": str(root), "train": ["train/*.parquet"], "test": ["train/*.parquet"],
        "shuffle": "buffer", "shuffle_buffer": buffer,
        "dense": {"column": "dense", "n_dense": N_DENSE}, "sparse": sparse,
        "sequences": {"history": {"items": "items", "actions": "actions", "timestamps": "timestamps",
                                  "num_items": 200_000, "num_actions": 4, "max_len": MAX_LEN}},
        "labels": {"ctr": "click", "cvr": "conversion"},
    }  # fmt: skip


def make_source(root: Path, buffer: int):
    from gem_train.config import ParquetConfig, config_from_dict
    from gem_train.data.parquet.reader import ParquetSource

    return ParquetSource(config_from_dict(ParquetConfig, section(root, buffer)), seed=0)


def one_worker(root: Path, buffer: int, batch_size: int, batches: int) -> dict:
    """Wall and CPU time of ``batches`` batches from the stream's start: every window read, decoded,
    checked, shuffled and converted counts (``batches x B`` should span several windows)."""
    src = make_source(root, buffer)
    t0, c0 = time.perf_counter(), time.process_time()
    it = src._train_batches(0, 1, batch_size, 0)
    events = 0
    for _ in range(batches):
        lb = next(it)
        events += int(lb.batch.sequences["history"].item_ids.numel())
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = batches * batch_size
    return {"examples_per_s": n / dt, "examples_per_cpu_s": n / cpu, "events_per_s": events / dt,
            "seconds": dt, "cpu_seconds": cpu}  # fmt: skip


def n_workers(root: Path, buffer: int, batch_size: int, batches: int, workers: int) -> dict:
    """Wall time of ``batches`` batches through ``make_train_loader(num_workers=workers)``, from the
    loader's start (worker start-up included, as a training run pays it once)."""
    from gem_train.data.loader import make_train_loader

    src = make_source(root, buffer)
    t0 = time.perf_counter()
    it = iter(make_train_loader(src, batch_size, num_workers=workers))
    for _ in range(batches):
        next(it)
    dt = time.perf_counter() - t0
    return {"examples_per_s": batches * batch_size / dt, "seconds": dt, "workers": workers}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def memory_child(root: Path, buffer: int, batch_size: int, batches: int) -> dict:
    """Peak RSS while reading ``batches`` batches with this shuffle buffer, above the RSS before (after a
    warm-up batch through a one-batch buffer, dropped again, so that torch's and Arrow's code and pools are
    loaded); the peak is reset there (``/proc/self/clear_refs``)."""
    import gc

    warm = make_source(root, batch_size)._train_batches(0, 1, batch_size, 0)
    next(warm)
    del warm
    gc.collect()
    src = make_source(root, buffer)
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    it = src._train_batches(0, 1, batch_size, 0)
    for _ in range(batches):
        next(it)
    peak = _status_kib("VmHWM")
    return {"buffer": buffer, "peak_rss_above_start_mib": (peak - base) / 1024, "rss_start_mib": base / 1024,
            "arrow_pool_peak_mib": pa.default_memory_pool().max_memory() / 2**20}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory of the JSON result")
    p.add_argument("--data", default="", help="where the table goes (default: OUT/data; reused if there)")
    p.add_argument("--rows", type=int, default=32_768)
    p.add_argument("--row-group", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--batches", type=int, default=0, help="batches timed (default: one epoch, rows // B)")
    p.add_argument("--buffer", type=int, default=16_384, help="shuffle buffer of the speed runs (rows)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mem-buffers", default="2048,8192,32768", help="shuffle buffers of the memory runs")
    p.add_argument("--mem-batches", type=int, default=24)
    p.add_argument("--_memory-child", dest="child", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    out = Path(a.out)
    root = Path(a.data) if a.data else out / "data"
    if a.child:
        print(json.dumps(memory_child(root, a.child, a.batch_size, a.mem_batches)))
        return
    out.mkdir(parents=True, exist_ok=True)
    path = root / "train" / "part-00000.parquet"
    if not path.exists() or pq.ParquetFile(path).metadata.num_rows != a.rows:
        t0 = time.perf_counter()
        write_data(path, a.rows, a.row_group)
        print(f"wrote {a.rows:,} rows to {path} ({path.stat().st_size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)  # fmt: skip
    res: dict = {"rows": a.rows, "row_group": a.row_group, "batch_size": a.batch_size, "buffer": a.buffer,
                 "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                 "file_mib": path.stat().st_size / 2**20}  # fmt: skip
    batches = a.batches or max(1, a.rows // a.batch_size)
    res["batches"] = batches
    res["one_worker"] = one_worker(root, a.buffer, a.batch_size, batches)
    res["n_workers"] = n_workers(root, a.buffer, a.batch_size, batches, a.workers)
    res["memory"] = []
    for buf in [int(x) for x in a.mem_buffers.split(",") if x]:
        cmd = [sys.executable, __file__, "--out", str(out), "--data", str(root)]
        cmd += [
            "--batch-size",
            str(a.batch_size),
            "--mem-batches",
            str(a.mem_batches),
            "--_memory-child",
            str(buf),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res["memory"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    o, w = res["one_worker"], res["n_workers"]
    print("| measurement | value |\n|---|---|")
    print(
        f"| one worker (in process) | {o['examples_per_s']:,.0f} examples/s wall, "
        f"{o['examples_per_cpu_s']:,.0f} per CPU second ({o['events_per_s'] / 1e6:.1f} M events/s) |"
    )
    print(f"| {w['workers']} DataLoader workers | {w['examples_per_s']:,.0f} examples/s |")
    for m in res["memory"]:
        print(
            f"| peak memory, shuffle buffer {m['buffer']:,} rows | "
            f"{m['peak_rss_above_start_mib']:,.0f} MiB RSS above start, "
            f"Arrow pool peak {m['arrow_pool_peak_mib']:,.0f} MiB |"
        )
    (out / "bench_parquet_reader.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
