"""``gem-train data inspect``: what a ``[data.parquet]`` dataset holds, read row group by row group.

Per split: rows (from the footers), rows that fail a check of the format (counted, as ``on_bad_row =
"skip"`` would leave them out, with the first reasons), label rates per task (and how many labels are null),
history-length quantiles per sequence (before truncation) and the share longer than ``max_len``; per id
feature the raw id range, ids out of ``[0, n)`` (``ids = "raw"``), not in the vocabulary (``"vocab"``), and
for ``ids = "hash"`` the distinct raw ids, the distinct rows they hash to and the collisions (distinct ids
minus distinct rows: ids that share a row with another). A PNG histogram of the history lengths is written.
Where the validation split comes from (``"validation"``: declared files, or the latest training rows by
time) and, given the batch size, a model size and run length for the training rows (``"suggestion"``,
:mod:`gem_train.evaluation.sizing`). Memory: one row group, plus the distinct ids of hashed features.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from gem_train.data.parquet.convert import Converter, Provenance
from gem_train.data.parquet.ids import splitmix64
from gem_train.data.parquet.reader import ParquetSource, _Reader
from gem_train.data.parquet.schema import SPLITS

__all__ = ["format_report", "inspect_dataset"]


class _IdStats:
    def __init__(self, mode: str, size: int) -> None:
        self.mode, self.size = mode, size
        self.lo: int | None = None
        self.hi: int | None = None
        self.count, self.out_of_range = 0, 0
        self.distinct: list[np.ndarray] = []

    def add(self, raw: np.ndarray) -> None:
        if not len(raw):
            return
        lo, hi = int(raw.min()), int(raw.max())
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)
        self.count += len(raw)
        if self.mode == "raw":
            self.out_of_range += int(((raw < 0) | (raw >= self.size)).sum())
        elif self.mode == "hash":
            self.distinct.append(np.unique(raw))
            if len(self.distinct) > 16:  # keep the union compact as groups stream by
                self.distinct = [np.unique(np.concatenate(self.distinct))]

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ids": self.count, "min": self.lo, "max": self.hi, "mode": self.mode}
        if self.mode == "raw":
            out["out_of_range"] = self.out_of_range
        if self.mode == "hash":
            raw = np.unique(np.concatenate(self.distinct)) if self.distinct else np.zeros(0, np.int64)
            rows = np.unique(splitmix64(raw) % np.uint64(self.size))
            out.update(distinct_ids=len(raw), distinct_rows=len(rows), collisions=len(raw) - len(rows))
            out["collision_rate"] = (len(raw) - len(rows)) / len(raw) if len(raw) else 0.0
        return out


def _flat_raw(arr: Any) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, flat values) of a list column, or of an int column (null = no id)."""
    import pyarrow as pa

    if pa.types.is_integer(arr.type):
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        return valid.astype(np.int64), arr.drop_null().to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return lengths, flat


def inspect_dataset(
    source: ParquetSource, png: str | Path | None = None, batch_size: int | None = None
) -> dict[str, Any]:
    """Statistics of every split of ``source`` (see the module docstring); ``png``: the histogram's path;
    with ``batch_size``, also a model size and run length for its training rows
    (:func:`gem_train.evaluation.sizing.suggest`)."""
    layout = source.layout
    skip_cfg = dataclasses.replace(source.cfg, on_bad_row="skip")
    converter = Converter(dataclasses.replace(layout, cfg=skip_cfg), source.spec, source.root)
    report: dict[str, Any] = {"splits": {}}
    all_lengths: dict[str, list[np.ndarray]] = {name: [] for name, _ in layout.sequences}
    for split, key in SPLITS.items():
        files = source.files.get(split)
        if files is None:
            continue
        ids = {f"sparse.{n}": _IdStats(sp.ids, sp.num_embeddings) for n, sp in layout.sparse}
        ids.update({f"sequences.{n}.items": _IdStats(sq.ids, sq.num_items) for n, sq in layout.sequences})
        pos = np.zeros(len(layout.labels))
        labelled = np.zeros(len(layout.labels))
        lengths: dict[str, list[np.ndarray]] = {name: [] for name, _ in layout.sequences}
        bad, reasons = 0, list[str]()
        reader = _Reader(files, source.columns)
        for g in range(len(files.group_rows)):
            table = reader.group(g)
            n = table.num_rows
            prov = Provenance(
                np.full(n, files.group_file[g]),
                np.full(n, files.group_index[g]),
                reader.physical_row(g, 0, n),
            )
            block = converter.block(table, prov, files.paths)
            bad += int(block.bad.sum())
            for i, why in list(block.reasons.items())[: max(0, 5 - len(reasons))]:
                path = files.paths[int(files.group_file[g])]
                row = int(prov.row[i])
                reasons.append(f"file {path}, row group {int(files.group_index[g])}, row {row}: {why}")
            for name, _sp in layout.sparse:
                ids[f"sparse.{name}"].add(
                    _flat_raw(table.column(layout.sparse_column[name]).combine_chunks())[1]
                )
            for name, sq in layout.sequences:
                ln, flat = _flat_raw(table.column(sq.items).combine_chunks())
                ids[f"sequences.{name}.items"].add(flat)
                lengths[name].append(ln)
            for j, (_, column) in enumerate(layout.labels):
                arr = table.column(column).combine_chunks()
                y = arr.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
                labelled[j] += len(y)
                pos[j] += float((y == 1).sum())
        rows = files.num_rows
        seqs = {}
        for name, sq in layout.sequences:
            ln = np.concatenate(lengths[name]) if lengths[name] else np.zeros(0, np.int64)
            all_lengths[name].append(ln)
            q = np.quantile(ln, [0.5, 0.9, 0.99]) if len(ln) else [0, 0, 0]
            seqs[name] = {
                "mean": float(ln.mean()) if len(ln) else 0.0, "p50": float(q[0]), "p90": float(q[1]),
                "p99": float(q[2]), "max": int(ln.max()) if len(ln) else 0, "empty": int((ln == 0).sum()),
                "longer_than_max_len": int((ln > sq.max_len).sum()), "max_len": sq.max_len,
            }  # fmt: skip
        report["splits"][key] = {
            "files": len(files.paths),
            "row_groups": len(files.group_rows),
            "rows": rows,
            "bad_rows": bad,
            "bad_row_examples": reasons,
            "labels": {
                task: {
                    "positive_rate": pos[j] / labelled[j] if labelled[j] else float("nan"),
                    "labelled": int(labelled[j]),
                    "null": int(rows - labelled[j]),
                }
                for j, (task, _) in enumerate(layout.labels)
            },
            "history_length": seqs,
            "ids": {k: v.result() for k, v in ids.items()},
        }
    if png is not None:
        _histogram(all_lengths, Path(png))
        report["histogram"] = str(png)
    report["validation"] = source.valid_note
    if batch_size is not None:
        from gem_train.evaluation.sizing import suggest

        report["suggestion"] = suggest(source.spec, source.rows("train"), batch_size).as_dict()
    return report


def _histogram(lengths: dict[str, list[np.ndarray]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, parts in lengths.items():
        ln = np.concatenate(parts) if parts else np.zeros(0)
        ax.hist(ln, bins=min(100, max(int(ln.max()) + 1 if len(ln) else 1, 1)), alpha=0.6, label=name)
    ax.set_xlabel("history length (events, before truncation)")
    ax.set_ylabel("rows")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("history lengths, all splits")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def format_report(report: dict[str, Any]) -> str:
    """The report as readable text."""
    lines = []
    for split, r in report["splits"].items():
        lines.append(f"{split}: {r['rows']:,} rows in {r['files']} file(s), {r['row_groups']} row group(s); "
                     f"{r['bad_rows']:,} bad row(s)")  # fmt: skip
        lines += [f"    {x}" for x in r["bad_row_examples"]]
        for task, t in r["labels"].items():
            lines.append(
                f"  label {task}: positive rate {t['positive_rate']:.4f} of {t['labelled']:,} labelled "
                f"({t['null']:,} null)"
            )
        for name, h in r["history_length"].items():
            lines.append(
                f"  history {name}: mean {h['mean']:.1f}, p50 {h['p50']:.0f}, p90 {h['p90']:.0f}, p99 "
                f"{h['p99']:.0f}, max {h['max']}; {h['empty']:,} empty, {h['longer_than_max_len']:,} longer "
                f"than max_len {h['max_len']} (truncated to the most recent)"
            )
        for name, s in r["ids"].items():
            extra = ""
            if "out_of_range" in s:
                extra = f", {s['out_of_range']:,} out of range"
            if "collisions" in s:
                extra = (
                    f", {s['distinct_ids']:,} distinct -> {s['distinct_rows']:,} rows: {s['collisions']:,} "
                    f"collisions ({100 * s['collision_rate']:.2f}%)"
                )
            lines.append(f"  ids {name} ({s['mode']}): {s['ids']:,} ids in [{s['min']}, {s['max']}]{extra}")
    if "histogram" in report:
        lines.append(f"histogram of history lengths: {report['histogram']}")
    if "validation" in report:
        lines.append(report["validation"])
    if "suggestion" in report:
        lines.append(report["suggestion"]["text"])
    return "\n".join(lines)
