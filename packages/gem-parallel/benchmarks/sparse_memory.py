"""Embedding memory and communication of 1D / 2D / fully sharded 2D sharding: the model at scale, and the
same quantities measured on 4 gloo CPU ranks for gem-parallel's toy model, side by side with the model.

- ``model``: :func:`sparse_memory_model.sparse_costs` for a trillion-parameter table set (below) at 1024 and
  4096 GPUs: per-rank resident / peak table bytes (fp32 weights + row-wise Adagrad state) and the per-step
  all-to-all, reduce-scatter, all-gather and all-reduce bytes of one rank.
- ``measure``: 4 CPU processes (gloo) run :class:`gem_parallel.testing.toy_model.ToyModel` with the tables of
  gem-model's ``small`` config (:func:`small_tables_config`: 25.7M table parameters) sharded 1D (G=4), 2D
  (G=2, R=2) and fully sharded 2D (G=2, R=2) by ``gem_parallel.sparse.shard_embeddings``; per rank the table
  bytes held between steps and, over one training step (forward, backward with the fused update, the
  replica step), the bytes of every collective (``gem_parallel.CollectiveBytes``), next to the model
  evaluated on the same tables and the same batch's id counts.

Usage (CPU, a few minutes on 2 loaded cores):
    python packages/gem-parallel/benchmarks/sparse_memory.py --out DIR
    python packages/gem-parallel/benchmarks/sparse_memory.py --parts model --out DIR   # seconds
Writes ``DIR/sparse_memory.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # also in the ranks, which load this file by path
from sparse_memory_model import Table, sparse_costs

STRATEGIES = (("1d", 4), ("2d", 2), ("fully_sharded_2d", 2))  # (strategy, sharding group) on 4 ranks
GIB = 2**30


def trillion_tables(dim: int = 256) -> tuple[list[Table], int]:
    """~1.0e12 fp32 parameters in tables of ``dim``-wide rows (an ads model at production scale): item ids of
    the behaviour history (sequence, 2,048 ids per sample) and its action types, two huge id tables (user,
    ad: pooled, one id each) and 100 attribute tables (pooled, 2 ids each). Returns tables and batch/rank."""
    tables = [
        Table("item", 2_300_000_000, dim, 2048, pooled=False),
        Table("action", 1_024, dim, 2048, pooled=False),
        Table("user_id", 1_000_000_000, dim, 1, pooled=True),
        Table("ad_id", 500_000_000, dim, 1, pooled=True),
    ]
    tables += [Table(f"attr_{i}", 1_000_000, dim, 2, pooled=True) for i in range(100)]
    return tables, 256


def model_rows(worlds: tuple[int, ...] = (1024, 4096), group: int = 256) -> list[dict]:
    tables, batch = trillion_tables()
    rows = []
    for world in worlds:
        for strategy, g, every in (
            ("1d", world, 1),
            ("2d", group, 1),
            ("2d", group, 8),
            ("fully_sharded_2d", group, 1),
        ):
            c = sparse_costs(
                tables, world=world, group=g, strategy=strategy, batch_per_rank=batch, sync_every=every
            )
            rows.append({**c.as_dict(), "params": sum(t.rows * t.dim for t in tables), "batch": batch,
                         "sync_every": every})  # fmt: skip
    return rows


# -- measurement on 4 gloo ranks ----------------------------------------------------------------------------


def small_tables_config():
    """A :class:`~gem_parallel.testing.toy_model.ToyConfig` with the tables of gem-model's ``small`` config
    (64-wide rows): user and ad ids (100,000 rows, one id), four attribute tables (1,000 / 100 rows, up to 2
    ids), and two histories (up to 256 and 128 events) each with an item (100,000 rows) and an action (8
    rows) sequence feature. The dense part is minimal: the measurement is about the tables."""
    from gem_parallel.testing.toy_model import ToyConfig

    bags = (("user_id", 100_000), ("user_attr_0", 1_000), ("user_attr_1", 1_000), ("ad_id", 100_000),
            ("ad_attr_0", 100), ("ad_attr_1", 100))  # fmt: skip
    sequences = (("history_item", 100_000), ("history_action", 8), ("ads_history_item", 100_000),
                 ("ads_history_action", 8))  # fmt: skip
    return ToyConfig(
        bag_features=bags, sequence_features=sequences, max_ids=2, max_len=256, embedding_dim=64,
        d_model=16, n_layers=1, n_experts=1, expert_hidden=16, ffn_hidden=16,
    )  # fmt: skip


def _tables_and_ids(model, batches) -> list[Table]:
    """The model's tables with each one's mean ids per sample over ``batches`` (what this rank looked up)."""
    from gem_parallel.sparse.plan import embedding_tables

    counts: dict[str, float] = {}
    samples = 0
    for b in batches:
        samples += b.batch_size
        for kjt in (b.bags, b.sequences):
            for key, n in zip(kjt.keys(), kjt.length_per_key()):
                counts[f"t_{key}"] = counts.get(f"t_{key}", 0.0) + float(n)
    return [
        Table(t.name, t.rows, t.dim, counts.get(t.name, 0.0) / samples, pooled=t.module == "bags")
        for t in embedding_tables(model.embeddings)
    ]


def _logged_bytes_class():
    from gem_parallel import CollectiveBytes
    from gem_parallel.comm_bytes import _nbytes

    class LoggedBytes(CollectiveBytes):
        """CollectiveBytes that also keeps (kind, bytes, dtype) of every call."""

        def __init__(self) -> None:
            super().__init__()
            self.log: list[tuple[str, int, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            entry = self._table.get(func)
            if entry is not None:
                kind, arg = entry
                t = out if arg is None else args[arg]
                n = _nbytes(t)
                self.bytes[kind] += n
                self.calls[kind] += 1
                first = t[0] if isinstance(t, list | tuple) and t else t
                self.log.append((kind, n, str(getattr(first, "dtype", "?"))))
            return out

    return LoggedBytes


def _measure_worker(rank: int, world: int, batch: int) -> dict:
    from gem_parallel import ParallelDims
    from gem_parallel.sparse import shard_embeddings, sparse_sharding
    from gem_parallel.testing.toy_model import ToyModel, toy_batch, toy_loss

    config = small_tables_config()
    _LoggedBytes = _logged_bytes_class()
    out = {}
    for strategy, group in STRATEGIES:
        model = ToyModel(config, seed=0)
        dims = ParallelDims(sparse_group=group)
        batches = [toy_batch(config, batch, seed=100 * s + rank) for s in range(2)]
        tables = _tables_and_ids(model, batches[1:])  # the ids of the counted step
        shard_embeddings(model, dims, dims.build_sparse_mesh("cpu"), strategy=strategy)
        handle = sparse_sharding(model)
        resident = handle.local_bytes()
        counted = None
        for step, b in enumerate(batches):  # step 0 warms up; step 1 is counted
            with _LoggedBytes() as cb:
                loss = toy_loss(model(b), b)
                loss.backward()
                handle.step()
            counted = cb
            if step == 0:
                peak_note = handle.local_bytes()
        assert counted is not None
        out[strategy] = {
            "resident": resident,
            "after_steps": peak_note,
            "bytes": dict(counted.bytes),
            "calls": dict(counted.calls),
            "log": counted.log,
            "tables": [t.__dict__ for t in tables],
        }
    return out


def measure_rows(batch: int) -> list[dict]:
    from gem_parallel.testing import run_distributed

    results = run_distributed(
        __file__, "_measure_worker", world_size=4, kwargs={"batch": batch}, timeout_s=500
    )
    rows = []
    for strategy, group in STRATEGIES:
        per_rank = [r[strategy] for r in results]
        # The model on the same tables with the ranks' mean ids per sample.
        names = [t["name"] for t in per_rank[0]["tables"]]
        tables = []
        for i, name in enumerate(names):
            t0 = per_rank[0]["tables"][i]
            ids = sum(r["tables"][i]["ids_per_sample"] for r in per_rank) / len(per_rank)
            tables.append(Table(name, t0["rows"], t0["dim"], ids, t0["pooled"]))
        model = sparse_costs(tables, world=4, group=group, strategy=strategy, batch_per_rank=batch)
        kinds = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")
        measured = {k: sum(r["bytes"].get(k, 0) for r in per_rank) / len(per_rank) for k in kinds}
        rows.append({
            "strategy": strategy, "group": group, "replicas": 4 // group,
            "resident_measured_mean": sum(r["resident"] for r in per_rank) / 4,
            "resident_measured_max": max(r["resident"] for r in per_rank),
            "resident_model": model.resident,
            **{f"{k}_measured": v for k, v in measured.items()},
            **{f"{k}_model": getattr(model, k) for k in kinds},
            "calls": per_rank[0]["calls"],
            "log_rank0": per_rank[0]["log"],
        })  # fmt: skip
    return rows


def _fmt(x: float) -> str:
    if x >= GIB:
        return f"{x / GIB:.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.2f} MiB"
    if x >= 1024:
        return f"{x / 1024:.1f} KiB"
    return f"{x:.0f} B"


def print_model(rows: list[dict]) -> None:
    head = (
        "| GPUs | strategy | G x R | resident / rank | peak / rank | all-to-all | reduce-scatter | all-gather"
    )
    print(f"\n{head} | all-reduce |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["strategy"] + (f" (sync every {r['sync_every']})" if r["strategy"] == "2d" else "")
        print(f"| {r['world']} | {name} | {r['group']} x {r['replicas']} | {_fmt(r['resident'])} | "
              f"{_fmt(r['peak'])} | {_fmt(r['all_to_all'])} | {_fmt(r['reduce_scatter'])} | "
              f"{_fmt(r['all_gather'])} | {_fmt(r['all_reduce'])} |")  # fmt: skip


def print_measured(rows: list[dict]) -> None:
    head = "| strategy | G x R | resident / rank: measured mean (max) / model | all-to-all: measured / model"
    print(f"\n{head} | reduce-scatter | all-gather | all-reduce |\n|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{_fmt(r[k + '_measured'])} / {_fmt(r[k + '_model'])}"
                 for k in ("all_to_all", "reduce_scatter", "all_gather", "all_reduce")]  # fmt: skip
        print(f"| {r['strategy']} | {r['group']} x {r['replicas']} | {_fmt(r['resident_measured_mean'])} "
              f"({_fmt(r['resident_measured_max'])}) / {_fmt(r['resident_model'])} | "
              + " | ".join(cells) + " |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="model,measure")
    ap.add_argument("--batch", type=int, default=4, help="samples per rank in the measurement")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    result: dict = {"argv": sys.argv[1:]}
    if "model" in parts:
        result["model"] = model_rows()
        print_model(result["model"])
    if "measure" in parts:
        result["measured"] = measure_rows(a.batch)
        print_measured(result["measured"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "sparse_memory.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / "sparse_memory.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
