"""The Parquet commands of ``gem-train data``: ``inspect``, ``export movielens-100k``, ``synthetic --format``.

gem-train data inspect --config F [--png PATH] [--json] [key=value ...]   (writes a file only with --png)
gem-train data export movielens-100k --format parquet [DIR] [--config C] [key=value ...]
gem-train data synthetic --format parquet DIR [--train-examples N] [--config C] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_parsers", "export_synthetic_command", "run"]

DEFAULT_MOVIELENS_DIR = "{cache}/ml-100k-parquet"


def add_parsers(dsub: argparse._SubParsersAction, cfg_help: str, ov_help: str) -> None:
    """Add ``inspect`` and ``export`` to the ``data`` subcommands."""
    ins = dsub.add_parser("inspect", help="statistics and checks of a [data.parquet] dataset")
    ins.add_argument("--config", required=True, help=cfg_help + " with data.source = 'parquet'")
    ins.add_argument(
        "--png", default=None, metavar="PATH", help="also write a histogram of history lengths to PATH (PNG)"
    )
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.add_argument("overrides", nargs="*", help=ov_help)
    ex = dsub.add_parser("export", help="write a built-in dataset as Parquet files")
    ex.add_argument("export_dataset", metavar="dataset", choices=("movielens-100k",))
    out_help = f"output directory (default {DEFAULT_MOVIELENS_DIR}: what movielens-parquet reads)"
    ex.add_argument("out", nargs="?", default=DEFAULT_MOVIELENS_DIR, help=out_help)
    ex.add_argument("--format", choices=("parquet",), default="parquet")
    ex.add_argument("--config", default="movielens", help=cfg_help + " (its [data.movielens] and seed)")
    ex.add_argument("--set", dest="overrides", action="append", default=[], help=ov_help)


def _resolve(out: str) -> Path:
    from gem_train.data.parquet.schema import resolve_root

    return resolve_root(out)


def run(args: argparse.Namespace) -> int:
    """Run ``data inspect`` or ``data export``."""
    from gem_train.config import ConfigError, load_config

    cfg = load_config(args.config, args.overrides)
    if args.dataset == "inspect":
        from gem_train.data.parquet.inspect import format_report, inspect_dataset
        from gem_train.data.parquet.reader import ParquetSource

        if cfg.data.source != "parquet":
            raise ConfigError(
                f"data inspect reads a [data.parquet] dataset; data.source is {cfg.data.source!r}"
            )
        source = ParquetSource(cfg.data.parquet, cfg.run.seed)
        report = inspect_dataset(source, args.png, batch_size=cfg.data.batch_size)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0
    from gem_train.data.parquet.export import export_movielens

    out = _resolve(args.out)
    counts = export_movielens(cfg, out)
    print(f"MovieLens-100K written to {out}: " + ", ".join(f"{k} {v:,} rows" for k, v in counts.items()))
    print(f"  its [data.parquet] section: {out / 'data.toml'}")
    extra = "" if args.out == DEFAULT_MOVIELENS_DIR else f" data.parquet.root={out}"
    print(f"  train with: gem-train train --config movielens-parquet{extra}")
    return 0


def export_synthetic_command(cfg_source: str | None, overrides: list[str], train_examples: int) -> int:
    """``gem-train data synthetic --format parquet DIR``: the first override without '=' is DIR."""
    from gem_train.config import ConfigError, load_config
    from gem_train.data.parquet.export import export_synthetic

    dirs = [o for o in overrides if "=" not in o]
    if len(dirs) != 1:
        raise ConfigError(f"data synthetic --format parquet needs one output directory, got {dirs}")
    cfg = load_config(cfg_source, [o for o in overrides if "=" in o])
    out = _resolve(dirs[0])
    counts = export_synthetic(cfg, out, train_examples)
    print(f"synthetic dataset (seed {cfg.run.seed}) written to {out}: "
          + ", ".join(f"{k} {v:,} rows" for k, v in counts.items()))  # fmt: skip
    print(f"  train with: gem-train train --config YOUR.toml, its [data] section from {out / 'data.toml'}")
    return 0
