"""What the checkpoint manifest costs: sha256 of a checkpoint-sized file against writing it.

    python packages/gem-train/benchmarks/bench_checkpoint_hashing.py --gb 4 --out /tmp/hash   # base-h200 size
    python packages/gem-train/benchmarks/bench_checkpoint_hashing.py --smoke --out /tmp/hash  # 64 MB

Writes ``--gb`` GB of random bytes to a file under ``--dir`` (default: a temporary directory), fsyncs it
(what DCP does for every checkpoint file), then hashes it with gem-train's ``hash_file`` (8 MiB reads,
hashlib's sha256, one core) twice: right after the write (the page cache is warm, as in the trainer's
background seal) and once more. Prints a table and writes ``hashing.json`` to ``--out``. Expected time:
about 2 x the write time plus 2 x 3 s for 4 GB on a 2-core CPU machine; a few seconds with ``--smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from gem_train.checkpoint.manifest import hash_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.0, help="file size in GB (1e9 bytes)")
    ap.add_argument("--smoke", action="store_true", help="64 MB only")
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    ap.add_argument("--out", required=True, help="folder for hashing.json")
    a = ap.parse_args()
    size = 64 * 10**6 if a.smoke else int(a.gb * 1e9)
    chunk = os.urandom(64 << 20)  # random bytes: sha256's speed does not depend on them, the disk's might
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = Path(d) / "shard.distcp"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            left = size
            while left > 0:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
            f.flush()
            t_write = time.perf_counter() - t0
            os.fsync(f.fileno())
        t_write_fsync = time.perf_counter() - t0
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            digest = hash_file(path)
            times.append(time.perf_counter() - t0)
        assert digest.size == size
    gb = size / 1e9
    out = {
        "bytes": size,
        "write_s": t_write,
        "write_fsync_s": t_write_fsync,
        "sha256_s": times,
        "sha256_gb_per_s": [gb / t for t in times],
        "cpu_count": os.cpu_count(),
    }
    print(f"{'size':>14} {'write':>9} {'+fsync':>9} {'sha256 #1':>10} {'sha256 #2':>10} {'GB/s':>6}")
    print(
        f"{gb:>11.2f} GB {t_write:>8.2f}s {t_write_fsync:>8.2f}s {times[0]:>9.2f}s {times[1]:>9.2f}s "
        f"{gb / min(times):>6.2f}"
    )
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "hashing.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
