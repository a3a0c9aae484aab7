"""The ``gem-train`` console script.

    gem-train                                  train the tiny model on synthetic data on the CPU (tiny-cpu)
    gem-train train [--config C] [--resume CKPT|RUN|latest [--allow-change KEY ...]] [key=value ...]
    gem-train eval --checkpoint CKPT [--split test|valid] [--batches N] [key=value ...]
    gem-train bench [--config C] [--steps N] [--warmup N] [key=value ...]
    gem-train predict --checkpoint CKPT --out DIR [--split S|all] [--embeddings] [key=value ...]
    gem-train baseline [--config C] [key=value ...]   the plain MLP baseline on the same data and split
    gem-train data movielens-100k [--cache-dir D] [--wheel W]
    gem-train data synthetic [--config C] [--format parquet DIR] [key=value ...]
    gem-train data export movielens-100k --format parquet [DIR]   the Parquet copy (movielens-parquet reads)
    gem-train data inspect --config F                  statistics and checks of a [data.parquet] dataset
    gem-train config [--config C] [key=value ...]     print the resolved config
    gem-train launch [torchrun options] COMMAND ...     torchrun that exits 0 after a signal once all saved

``--config`` takes a TOML file or a shipped config name (``gem_train.configs.SHIPPED_CONFIGS``: tiny-cpu,
movielens, movielens-tuned, base-h200, large-h200, movielens-parquet).

Building the parser imports neither torch nor the config schema (each command imports what it needs), so
``--help`` answers at once. :func:`main` returns the exit status; :func:`console_main` is the program (the
console script, ``python -m gem_train.cli`` and every torchrun worker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gem_train.cli.launch import COMMANDS as LAUNCHED_COMMANDS
from gem_train.cli.stderr import say
from gem_train.configs import SHIPPED_CONFIGS
from gem_train.data.split import HELD_OUT, HeldOutSplit

if TYPE_CHECKING:
    from gem_train.config import TrainConfig

__all__ = ["console_main", "main"]


def _count(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= ``minimum`` (a usage error, exit 2, otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gem-train",
        description="Train and evaluate GEM-style ads recommendation models. With no command: train the tiny "
        "model on the built-in synthetic dataset on the CPU (config tiny-cpu).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command")
    cfg_help = f"a TOML file or a shipped config ({', '.join(SHIPPED_CONFIGS)})"
    ov_help = "dotted overrides, e.g. train.steps=100 optim.lr=3e-4"

    t = sub.add_parser("train", help="train a model")
    t.add_argument("--config", default=None, help=cfg_help + "; default tiny-cpu, or the checkpoint's")
    t.add_argument("--resume", default=None, help="a checkpoint dir, a run dir (its newest), or 'latest'")
    t.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: a setting (dotted key, or a prefix such as data.parquet) that may differ from "
        "the checkpoint's run although it changes what the run means; repeat for several (anything else "
        "that differs is refused)",
    )
    t.add_argument("overrides", nargs="*", help=ov_help)

    b = sub.add_parser("baseline", help="a baseline on the same data and split: the plain MLP or GBDT")
    b.add_argument("--config", default="movielens", help=cfg_help)
    b.add_argument(
        "--model",
        choices=("mlp", "gbdt"),
        default="mlp",
        help="mlp: the plain MLP (model.arch=mlp, trained like GEM); gbdt: gradient-boosted trees on causal "
        "features (model.gbdt.library, XGBoost by default: the gbdt extra), trees chosen on validation",
    )
    b.add_argument("overrides", nargs="*", help=ov_help)

    e = sub.add_parser("eval", help="evaluate a checkpoint on its config's test (or validation) split")
    e.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoints/step_<N> or checkpoints/best directory (or a run dir: its newest step_<N>)",
    )
    e.add_argument(
        "--split",
        choices=HELD_OUT,
        default="test",
        help="the held-out split: test (default) or valid (the validation split used for model selection)",
    )
    e.add_argument("--batches", type=_count(0), default=0, help="evaluate only the first N batches (0: all)")
    e.add_argument("overrides", nargs="*", help=ov_help + " (applied to the checkpoint's config)")

    be = sub.add_parser("bench", help="measure examples/s, step time, MFU and peak memory")
    be.add_argument("--config", default=None, help=cfg_help)
    be.add_argument("--steps", type=_count(1), default=20)
    be.add_argument("--warmup", type=_count(0), default=5)
    be.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    be.add_argument("overrides", nargs="*", help=ov_help)

    d = sub.add_parser("data", help="prepare or inspect a dataset")
    dsub = d.add_subparsers(dest="dataset", required=True)
    ml = dsub.add_parser("movielens-100k", help="fetch MovieLens-100K (pip download recbole==1.2.1)")
    ml.add_argument("--cache-dir", default=None, help="default: $GEM_CACHE_DIR or ~/.cache/gem")
    ml.add_argument("--wheel", default=None, help="use this recbole-1.2.1 wheel instead of downloading")
    sy = dsub.add_parser("synthetic", help="describe the synthetic dataset and its ground-truth NE floor")
    sy.add_argument("--config", default=None, help=cfg_help)
    sy.add_argument("overrides", nargs="*", help=ov_help + "; with --format parquet, also the output DIR")
    fmt_help = "text: print the statistics; parquet: write the dataset as Parquet files to DIR"
    sy.add_argument("--format", choices=("text", "parquet"), default="text", help=fmt_help)
    sy.add_argument("--train-examples", type=_count(1), default=65_536, help="--format parquet: train rows")
    from gem_train.data.parquet.cli import add_parsers as add_parquet_parsers  # inspect, export (issue 17)

    add_parquet_parsers(dsub, cfg_help, ov_help)

    from gem_train.cli.predict import add_parser as add_predict_parser  # batch inference (issue 36)

    add_predict_parser(sub, _count, ov_help)

    c = sub.add_parser("config", help="print the resolved config as TOML")
    c.add_argument("--config", default=None, help=cfg_help)
    c.add_argument("overrides", nargs="*", help=ov_help)

    la = sub.add_parser(
        "launch",
        help="torchrun (same options) running a gem-train command on every worker; exits 0 after "
        "SIGTERM/SIGINT once every worker saved its checkpoint",
        description="torchrun (its own launcher, the same options: `torchrun --help`) running `gem-train "
        "COMMAND ...` on every worker. It exits 0 after SIGTERM/SIGINT once every worker saved its "
        "checkpoint (and prints how to resume), 1 if a worker failed. OMP_NUM_THREADS defaults to 1 per "
        "worker, as torchrun's does. Example: gem-train launch --standalone --nproc-per-node 2 train "
        "--config tiny-cpu",
        usage="gem-train launch [-h] [torchrun options] COMMAND [args ...]",
    )
    la.add_argument(
        "torchrun_and_command",
        nargs=argparse.REMAINDER,
        metavar="[torchrun options] COMMAND ...",
        help=f"COMMAND: one of {', '.join(LAUNCHED_COMMANDS)}, with its arguments",
    )
    return p


def _launch_asks_help(argv: list[str]) -> bool:
    """Whether ``gem-train launch ARGV`` asks for help: -h/--help before the launched command."""
    head = next((argv[:i] for i, a in enumerate(argv) if a in LAUNCHED_COMMANDS), argv)
    return "-h" in head or "--help" in head


def _checkpoint_config(ckpt: Path, overrides: list[str]) -> tuple[TrainConfig, Path]:
    from gem_train.checkpoint import read_trainer_state
    from gem_train.config import TrainConfig, apply_overrides, config_from_dict
    from gem_train.loop.run_dir import resolve_checkpoint

    ckpt = resolve_checkpoint(ckpt)
    state = read_trainer_state(ckpt)
    cfg = config_from_dict(TrainConfig, apply_overrides(state["config"], overrides))
    cfg.validate()
    return cfg, ckpt


def _train(cfg: TrainConfig, resume: str | None, allow_changes: list[str] | None = None) -> int:
    from gem_train.cli.launch import write_worker_status
    from gem_train.loop.trainer import Trainer

    trainer = Trainer(cfg, resume=resume, allow_changes=allow_changes or ())
    if trainer.dist.is_main:
        print(f"gem-train: run directory {trainer.run_dir.root}", file=sys.stderr)
    result = trainer.fit()
    write_worker_status(result.status, result.step, result.last_checkpoint)
    if trainer.dist.is_main:
        if result.final_eval is not None:
            print(f"evaluation after {result.step} steps (test split, final model):")
            print(result.final_eval.summary())
        if result.best_eval is not None:
            print(
                f"test split of the best-validation checkpoint (step {result.best_step}, validation NE "
                f"[{cfg.train.select_task}] {result.best_valid_ne:.4f}; {result.best_checkpoint}):"
            )
            print(result.best_eval.summary())
        if result.early_stopped:
            print(
                f"early stop: step {result.step} of {trainer.schedule.steps}, best-validation step "
                f"{result.best_step} (train.early_stop_patience = {cfg.train.early_stop_patience})"
            )
        print(f"run directory: {result.run_dir}")
    return 0


def _gbdt(cfg: TrainConfig) -> int:
    from gem_train.evaluation.baselines.gbdt import build_gbdt_source, run_gbdt, write_gbdt_result
    from gem_train.loop.run_dir import create_run_dir

    source = build_gbdt_source(cfg)
    result = run_gbdt(cfg, source)
    run = create_run_dir(cfg.run.out_dir, f"{cfg.run.name}-gbdt")
    path = write_gbdt_result(result, run.root)
    print(f"gbdt baseline ({result.seconds:.0f} s; trees and grid point chosen on the validation split):")
    print(result.summary())
    print(f"results: {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from gem_train.checkpoint import load_checkpoint
    from gem_train.config import ConfigError
    from gem_train.evaluation.evaluate import evaluate_model
    from gem_train.loop.build import build_run

    cfg, ckpt = _checkpoint_config(Path(args.checkpoint), args.overrides)
    run = build_run(cfg, training=False)
    split: HeldOutSplit = args.split
    if not run.source.num_batches(split, cfg.data.eval_batch_size):
        raise ConfigError(
            "this dataset has no validation split (data.synthetic.valid_examples, "
            "data.movielens.valid_fraction or data.parquet.valid_fraction is 0); use --split test or set it"
        )
    state = load_checkpoint(ckpt, run.model, None, restore_rng=False)
    step = int(state["step"])
    res = evaluate_model(run.model, run.source, cfg, run.dist, run.autocast_dtype, step, args.batches, split)
    if run.dist.is_main:
        print(f"checkpoint {ckpt} (step {step}), {split} split:")
        print(res.summary())
    return 0


def _bench(args: argparse.Namespace) -> int:
    from gem_train.config import load_config
    from gem_train.loop.bench import run_bench

    cfg = load_config(args.config, args.overrides)
    out = run_bench(cfg, steps=args.steps, warmup=args.warmup)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v:,.4g}" if isinstance(v, float) else f"{k:>22}: {v}")
    return 0


def _data(args: argparse.Namespace) -> int:
    if args.dataset in ("inspect", "export"):  # the Parquet format (gem_train.data.parquet)
        from gem_train.data.parquet.cli import run as run_parquet

        return run_parquet(args)
    if args.dataset == "synthetic" and args.format == "parquet":
        from gem_train.data.parquet.cli import export_synthetic_command

        return export_synthetic_command(args.config, args.overrides, args.train_examples)
    if args.dataset == "movielens-100k":
        from gem_train.data.movielens import MovieLens100K, fetch_movielens_100k, read_movielens_100k

        path = fetch_movielens_100k(args.cache_dir, args.wheel)
        ev = read_movielens_100k(path)
        from gem_train.config import MovieLensConfig

        ml = MovieLens100K(MovieLensConfig(), events=ev)
        print(f"MovieLens-100K in {path}")
        print(
            f"  {len(ev.user):,} ratings, {len(set(ev.user.tolist()))} users, {ev.num_items - 1} movies; "
            f"train {len(ml.train_rows):,} / valid {len(ml.valid_rows):,} / test {len(ml.eval_rows):,} "
            "events; "
            f"positive rate {ml.label.mean():.3f}"
        )
        if args.cache_dir:
            print(
                f"  train with: gem-train train --config movielens data.movielens.cache_dir={args.cache_dir}"
            )
        else:
            print("  train with: gem-train train --config movielens")
        return 0
    from gem_train.config import load_config
    from gem_train.data.synthetic import SyntheticAds
    from gem_train.evaluation.metrics import ground_truth_ne

    cfg = load_config(args.config, args.overrides)
    ds = SyntheticAds(cfg.data.synthetic, cfg.run.seed)
    import numpy as np

    bs = cfg.data.eval_batch_size
    parts = [ds.get_batch("test", i, bs) for i in range(ds.held_out_batches("test", bs))]
    lengths = np.concatenate([p.batch.sequences["history"].lengths.numpy() for p in parts])
    sp = ds.spec
    print(f"synthetic ads dataset (seed {cfg.run.seed}): {sp.n_dense} dense features, tasks {sp.tasks}")
    print("  sparse: " + ", ".join(f"{f.name}[{f.num_embeddings}x{f.max_ids}]" for f in sp.sparse))
    print(
        "  sequences: "
        + ", ".join(f"{s.name}(items {s.num_items}, max_len {s.max_len})" for s in sp.sequences)
    )
    print(
        f"  history length ({cfg.data.synthetic.history_dist}): mean {lengths.mean():.1f}, median "
        f"{np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}"
    )
    masks = [p.batch.label_mask.numpy() for p in parts]
    labels = [p.batch.labels.numpy() for p in parts]
    floors = ground_truth_ne([p.true_probs for p in parts], labels, masks, sp.tasks)
    # The same for an oracle that cannot identify users (their own taste noise and bias integrated out).
    ident = ground_truth_ne([p.identifiable_probs[:, None] for p in parts], labels, masks, ("ctr",))
    for j, task in enumerate(sp.tasks):
        m = np.concatenate(masks)[:, j]
        y = np.concatenate(labels)[m, j]
        extra = f", identifiable floor {ident['ctr']:.4f}" if task == "ctr" else ""
        print(f"  {task}: base rate {y.mean():.4f}, ground-truth NE floor {floors[task]:.4f}{extra}")
    return 0


def _collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a failed collective of a multi-process run (a peer died, or a timeout)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return any(k in text for k in ("gloo", "Gloo", "NCCL", "Connection", "timed out", "Timed out", "Timeout"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gem-train``; returns the exit status (2: usage or config error, 1: failure,
    128 + signal: stopped at once by a second SIGTERM/SIGINT). Known errors (bad data, a missing file, a
    corrupt checkpoint, a non-finite loss, a failed collective) print one line, ``gem-train: error: ...``;
    an error raised in a DataLoader worker is the same error as without workers."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        if _launch_asks_help(argv[1:]):
            _parser().parse_args(["launch", "--help"])  # prints launch's help and exits 0
        from gem_train.cli.launch import main as launch_main

        return launch_main(argv[1:])
    args = _parser().parse_args(argv)
    from gem_train.loop.known_warnings import filter_known_warnings

    filter_known_warnings()  # before torch is imported: this process and its loader workers
    from gem_train.checkpoint import CheckpointError
    from gem_train.config import ConfigError, load_config
    from gem_train.data.movielens import DataFetchError, MovieLensFormatError
    from gem_train.data.parquet.errors import ParquetDataError
    from gem_train.data.workers import LoaderWorkerError
    from gem_train.loop.signals import StopNow
    from gem_train.loop.trainer import NonFiniteLossError
    from gem_train.transfer.errors import TransferDataError

    try:
        if args.command is None:
            return _train(load_config("tiny-cpu"), None)
        if args.command == "train":
            if args.allow_change and not args.resume:
                raise ConfigError("--allow-change names what a resume may change: it needs --resume")
            if args.resume and args.config is None:  # the checkpoint's own config (plus the overrides)
                target = args.resume
                if target == "latest":  # the newest run of the name (tiny-cpu's, or run.name=...)
                    from gem_train.loop.run_dir import pick_latest

                    base = load_config(None, args.overrides)
                    target = pick_latest(base.run.name, base.run.out_dir)[0]
                cfg, _ = _checkpoint_config(Path(target), args.overrides)
            else:
                cfg = load_config(args.config, args.overrides)
            return _train(cfg, args.resume, args.allow_change)
        if args.command == "baseline" and args.model == "gbdt":
            return _gbdt(load_config(args.config, args.overrides))
        if args.command == "baseline":
            cfg = load_config(args.config, ["model.arch=mlp", *args.overrides])
            cfg.run.name = f"{cfg.run.name}-baseline"
            return _train(cfg, None)
        if args.command == "eval":
            return _eval(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "predict":
            from gem_train.cli.predict import run as run_predict

            return run_predict(args, _checkpoint_config)
        if args.command == "data":
            return _data(args)
        if args.command == "config":
            from gem_train.config import config_to_dict, dumps_toml

            print(dumps_toml(config_to_dict(load_config(args.config, args.overrides))), end="")
            return 0
    except ConfigError as e:
        say(f"gem-train: config error: {e}")
        return 2
    except (
        NonFiniteLossError,
        MovieLensFormatError,
        ParquetDataError,
        DataFetchError,
        CheckpointError,
        LoaderWorkerError,
        TransferDataError,
        OSError,  # a missing or unreadable file (FileNotFoundError, PermissionError, ...)
    ) as e:
        say(f"gem-train: error: {e}")
        return 1
    except RuntimeError as e:
        if not _collective_failure(e):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        say(
            f"gem-train: error: rank {rank}: a collective failed ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:300]}): another rank died or did not answer within the "
            "collective timeout (parallel.timeout_s); the newest complete checkpoint of the run resumes "
            "with --resume"
        )
        return 1
    except KeyboardInterrupt as e:  # a second signal (StopNow), or Ctrl-C outside the training loop
        import signal

        signum = e.signum if isinstance(e, StopNow) else signal.SIGINT
        say(
            f"gem-train: {signal.Signals(signum).name}: stopped at once, without a new checkpoint (the "
            "newest complete one, if any, resumes with --resume)"
        )
        return 128 + int(signum)
    finally:
        if "torch.distributed" in sys.modules:  # never imported by a command that needs no torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return 2


def console_main() -> NoReturn:
    """The ``gem-train`` program: :func:`main`, then the end of the process.

    One process ends as usual. A worker of a multi-process run (``WORLD_SIZE`` > 1, as torchrun sets) ends
    with ``os._exit`` once everything it wrote is out: its loader workers shut down, a checkpoint seal
    joined (after a success; a failed run leaves the one in flight unsealed, as a crash would, and the
    previous checkpoint complete), logging, stdout and stderr flushed (TensorBoard and the metrics file were
    closed by the trainer), the process group destroyed (by :func:`main`). Interpreter finalization is
    skipped: a gloo thread still releasing a finished collective's tensors while the interpreter finalizes
    aborts the process after success (SIGABRT: pytorch/pytorch#190489, as ``gem_parallel.testing`` found).
    """
    try:
        code = main()
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, its message printed)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:  # Ctrl-C before main() could handle it (while importing)
        code = 130
    except BaseException:  # an unexpected error: its traceback, exit status 1
        import traceback

        traceback.print_exc()
        code = 1
    if not _multi_rank():
        raise SystemExit(code)
    _flush_before_exit(code)
    os._exit(code)


def _multi_rank() -> bool:
    """Whether this process is one rank of several (torchrun's ``WORLD_SIZE``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _flush_before_exit(code: int) -> None:
    """What must be out before ``os._exit`` skips interpreter finalization (see :func:`console_main`)."""
    import contextlib
    import logging

    if "gem_train.data.workers" in sys.modules:
        from gem_train.data.workers import close_all_loaders

        close_all_loaders()
    if code == 0 and "gem_train.checkpoint.save" in sys.modules:
        from gem_train.checkpoint.save import checkpoint_pending, wait_for_local_seal

        if checkpoint_pending():
            wait_for_local_seal()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can go out
            stream.flush()
