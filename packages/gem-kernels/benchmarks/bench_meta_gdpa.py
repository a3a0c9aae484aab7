"""Our GDPA forward against Meta's open Triton GDPA forward, at bench_attention's ``self_silu_b64`` case.

Meta's kernel is ``gdpa/triton`` of facebookresearch/ads_model_kernel_library, forward only (its backward
does not compile on upstream Triton). None of its code is in this repository:
``benchmarks/stage_meta_gdpa.sh`` exports it from a local mirror into a git-ignored folder laid out as the
``ads_mkl.ops.oss.gdpa`` package its imports expect, and ``--meta-root`` puts that folder on ``sys.path`` at
run time.

Case: non-causal GDPA with silu, jagged self-attention, B=64 log-normal lengths <= 4096 (mean ~1404), H=4,
D=128, bf16; the inputs of ``bench_attention.setup_case("self_silu_b64")``. Both sides compute
``out_i = 1/max_len * sum_j silu(q_i.k_j / sqrt(D)) v_j``. Ours runs as bench_attention calls it (default
``qk_scale = D**-0.5``, ``out_scale = 1/max_len``). Meta's kernel computes ``qk_scale * act(q.k)``: its
scale comes after the activation and there is none before it, so it gets ``qk_scale = 1/max_len`` and
``q / sqrt(D)``, computed once in fp32 and rounded to bf16 outside the timing (the check below also
compares it with the reference on exactly those inputs).

Activation: Meta's ``"silu"`` (``x * tl.sigmoid(x)``, Triton's standard fp32 sigmoid) and ``"fast_silu"``
(``__fdividef(x, 1 + __expf(-x))``, libdevice's approximate exp and division) both compute SiLU, the
function of our ``activation="silu"``; they differ only by fp32 rounding, far below the bf16 output's. Ours
evaluates the sigmoid on CUDA with the hardware ``tanh.approx`` (0.5 + 0.5 tanh(x/2)), so the like-for-like
counterpart is ``fast_silu``, the default; ``--meta-activations fast_silu,silu`` times both.

Meta variants (``--meta-variants``): ``base`` (their defaults, as their own benchmark calls it), ``tma``
(``enable_tma=True``: device-side tensor descriptors), ``persistent``, ``persistent_tma``. Each one is
autotuned afresh (the autotune key ignores these flags and the activation, so the cache is cleared first)
over ``--meta-configs``: their ``default`` set (36 configs), ``omnifm_v2`` (8), or ``all`` (the union, 40).

Check: relative Frobenius errors on the first ``--check-seqs`` sequences against the fp32 PyTorch reference,
next to the error of the reference's own bf16 output (pass: ``err <= 4 * ref_err + 2e-3``, as in
bench_attention), and Meta's output against ours on the whole batch. Timing: CUDA events, one event pair per
call, an L2 flush between calls (as triton's do_bench), ``--rounds`` rounds that alternate the kernels with
``--iters`` calls each after a warm-up call; the median over all calls. Compilation and autotuning (ours and
Meta's) happen in the warm-up, before the check. Useful TFLOP/s count valid pairs only: ``4 * sum(L_i^2) * H
* D``. The speedup is Meta's time / ours (the target is >= 1.1x the best Meta row).

    # once, where the mirror is; then carry .gpu/meta_gdpa to the GPU machine
    bash packages/gem-kernels/benchmarks/stage_meta_gdpa.sh
    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/bench_meta_gdpa.py --meta-root .gpu/meta_gdpa [--json out.json]
    # CPU smoke test of the glue: Triton interpreter (set by --small), tiny fp32 shapes, no autotuning:
    python packages/gem-kernels/benchmarks/bench_meta_gdpa.py --meta-root .gpu/meta_gdpa --small

In ``--small`` mode Meta's op is called through its Triton implementation directly: on CPU tensors the
registered op dispatches to Meta's CPU fallback, which is plain softmax attention whatever the activation.
``fast_silu`` cannot run in the interpreter (it has no ``fast_expf``/``fast_dividef``); the smoke test then
reports that and checks ``silu`` instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

META_MODULE = "ads_mkl.ops.oss.gdpa.triton.triton_generalized_dot_product_attention"
META_OP = "gdpa::generalized_dot_product_attention"
CASE = "self_silu_b64"
META_VARIANTS: dict[str, dict[str, bool]] = {
    "base": {},
    "tma": {"enable_tma": True},
    "persistent": {"enable_persistent": True},
    "persistent_tma": {"enable_persistent": True, "enable_tma": True},
}
META_ACTIVATIONS = ("fast_silu", "silu")
_META_CONFIG_SETS: dict[str, Any] = {}  # Meta's forward config sets as imported
SMALL_DIVISOR = 16  # --small: bench_attention.SMOKE (divides the batch and the lengths: 4 sequences <= 256)


# ------------------------------------------------------------------------------------------ Meta's module


def import_meta(root: str) -> ModuleType:
    """Meta's GDPA module from the staged folder ``root``; exits with status 2 when it cannot be imported."""
    pkg = Path(root) / "ads_mkl" / "ops" / "oss" / "gdpa" / "triton"
    if not pkg.is_dir():
        stage = "packages/gem-kernels/benchmarks/stage_meta_gdpa.sh"
        print(f"error: no staged Meta GDPA in {root!r}; run {stage}", file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(Path(root).resolve()))
    try:
        return importlib.import_module(META_MODULE)
    except Exception as e:
        traceback.print_exc()
        print(f"error: cannot import {META_MODULE} from {root!r}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)


def meta_source(root: str) -> str:
    path = Path(root) / "SOURCE.txt"
    return path.read_text().strip().replace("\n", "; ") if path.is_file() else "unknown"


def _config_key(cfg: Any) -> tuple[Any, ...]:
    return (tuple(sorted(cfg.kwargs.items())), cfg.num_warps, cfg.num_stages)


def select_meta_configs(mod: ModuleType, which: str) -> int:
    """Point Meta's forward autotuner at the config set ``which`` (before its first call); the count."""
    if not _META_CONFIG_SETS:  # their sets as imported (this replaces the active one)
        _META_CONFIG_SETS.update(mod.fwd_autotune_configs)
    original = _META_CONFIG_SETS
    sets = [original["default"], original["omnifm_v2"]] if which == "all" else [original[which]]
    chosen: dict[tuple[Any, ...], Any] = {}
    for configs in sets:
        for cfg in configs:
            chosen.setdefault(_config_key(cfg), cfg)
    mod.fwd_autotune_configs[mod.AUTOTUNE_CONFIG_SET] = tuple(chosen.values())
    return len(chosen)


def meta_autotuner(mod: ModuleType, persistent: bool) -> Any:
    """The triton Autotuner that Meta's op launches (the same lru_cache keys as its own call)."""
    kernel = mod._gdpa_fwd_persistent if persistent else mod._gdpa_fwd
    unrolled = mod.unroll_varargs(kernel, N=0, unroll_as_const=True)
    return mod.get_autotune_fwd_kernel(unrolled, False, is_mtia=False)


def meta_entry(mod: ModuleType, raw: bool) -> Callable[..., torch.Tensor]:
    """Meta's public ``generalized_dot_product_attention``, or (``raw``) the Triton implementation of its op,
    bypassing the dispatcher (which sends CPU tensors to Meta's softmax-only CPU fallback)."""
    if not raw:
        fn: Callable[..., torch.Tensor] = mod.generalized_dot_product_attention
        return fn
    from torch._library.custom_ops import OPDEFS

    impl: Callable[..., torch.Tensor] = OPDEFS[META_OP]._init_fn
    return impl


def root_cause(e: BaseException) -> str:
    """The innermost exception of a chain (the interpreter wraps each frame's error in another)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {str(e)[:400]}"


# ------------------------------------------------------------------------------------------ checks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo: torch.Tensor, max_len: int, qk_scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gem_kernels' PyTorch reference of the case on these sequences: fp32 output and bf16-output copy."""
    from gem_kernels import gdpa, use_backend

    out = []
    for dtype in (torch.float32, q.dtype):
        with use_backend("reference"), torch.no_grad():
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            out.append(
                gdpa(
                    qd,
                    kd,
                    vd,
                    qo,
                    None,
                    max_q_len=max_len,
                    activation="silu",
                    qk_scale=qk_scale,
                    out_scale=1.0 / max(max_len, 1),
                )
            )
    return out[0], out[1]


def check_row(out: torch.Tensor, r32: torch.Tensor, r16: torch.Tensor, nq: int) -> dict[str, Any]:
    err, ref_err = rel(out[:nq], r32), rel(r16, r32)
    ok = err <= 4 * ref_err + 2e-3 and bool(torch.isfinite(out).all())
    return {"err": err, "ref_err": ref_err, "ok": ok}


# ------------------------------------------------------------------------------------------ timing


def time_interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, iters: int, cuda: bool
) -> dict[str, dict[str, float]]:
    """Median and min milliseconds per function: ``rounds`` rounds alternating the functions, each a
    warm-up call then ``iters`` calls, each call between its own CUDA events after an L2 flush (wall clock
    on the CPU)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cuda else None
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            if flush is not None:
                events = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(iters)
                ]
                for start, end in events:
                    flush.zero_()
                    start.record()
                    fn()
                    end.record()
                torch.cuda.synchronize()
                times[name] += [start.elapsed_time(end) for start, end in events]
            else:
                for _ in range(iters):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: {"ms": statistics.median(t), "min_ms": min(t)} for name, t in times.items()}


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--meta-root", required=True, help="folder staged by benchmarks/stage_meta_gdpa.sh")
    ap.add_argument("--meta-variants", default="base,tma", help=f"comma-separated, of {list(META_VARIANTS)}")
    ap.add_argument("--meta-activations", default="fast_silu", help=f"comma-separated, of {META_ACTIVATIONS}")
    ap.add_argument("--meta-configs", default="all", choices=("default", "omnifm_v2", "all"))
    ap.add_argument("--ours-variant", default="auto", help="bench_attention's --variant for our kernel")
    ap.add_argument("--check-seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the rows and settings here")
    ap.add_argument("--small", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1, tiny, fp32)")
    a = ap.parse_args()
    for v in a.meta_variants.split(","):
        if v not in META_VARIANTS:
            ap.error(f"unknown Meta variant {v!r}")
    for act in a.meta_activations.split(","):
        if act not in META_ACTIVATIONS:
            ap.error(f"unknown Meta activation {act!r}")
    return a


def main() -> int:
    a = parse_args()
    if a.small:
        # Before any Triton kernel is defined: the interpreter, and Meta's single config (no autotuning).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["GDPA_DISABLE_AUTOTUNE"] = "1"
        a.check_seqs, a.rounds, a.iters = min(a.check_seqs, 4), 1, 1
    cuda = not a.small
    if cuda and not torch.cuda.is_available():
        sys.exit("error: no CUDA device (use --small for the CPU smoke test)")
    mod = import_meta(a.meta_root)

    import bench_attention as ba
    import triton

    from gem_kernels import use_backend
    from gem_kernels.attention import testing

    if a.small:
        ba.DEV, ba.SMOKE, ba.DTYPE = "cpu", SMALL_DIVISOR, torch.float32
        n_configs = 1
    else:
        n_configs = select_meta_configs(mod, a.meta_configs)
    device = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    print(f"device: {device}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"Meta GDPA: {meta_source(a.meta_root)}; TMA supported: {mod.is_tma_supported()}")

    torch.manual_seed(0)
    c = ba.setup_case(CASE)
    act, causal, window, _ = ba.CASES[CASE]
    assert act == "silu" and not causal and window is None
    q, k, v, qo, max_len = c["q"], c["k"], c["v"], c["qo"], c["max_q"]
    fwd_flop = 4 * c["pairs"] * ba.H * ba.D
    n_seq = min(a.check_seqs, c["lq"].numel())
    nq = int(qo[n_seq])
    print(
        f"case {CASE}: B={c['lq'].numel()} mean len {c['lq'].float().mean():.0f} max {max_len} H={ba.H} "
        f"D={ba.D} {c['q'].dtype}; {fwd_flop / 1e9:.1f} useful GFLOP per forward"
    )
    result: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "meta_source": meta_source(a.meta_root),
        "meta_configs": n_configs,
        "case": {"name": CASE, "B": c["lq"].numel(), "max_len": max_len, "pairs": c["pairs"]},
        "args": vars(a),
        "rows": [],
    }

    def save() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)

    # Ours: bench_attention's forward call; compiled and tuned by the first call.
    ours = ba.Ours(act, q, k, v, qo, None, max_len, None, causal, window)

    def ours_fwd() -> torch.Tensor:
        with testing.forced(variant=a.ours_variant), use_backend("triton" if a.small else "auto"):
            out: torch.Tensor = ours.fwd()
        return out

    t0 = time.time()
    out_ours = ours_fwd()
    sync(cuda)
    rows: dict[str, dict[str, Any]] = {"ours": {"kernel": "ours", "tune_s": time.time() - t0}}

    # Meta's: the same function (see the module docstring for the scale and the activation).
    q_meta = (q.float() * ba.D**-0.5).to(q.dtype)
    meta_fn = meta_entry(mod, raw=a.small)
    meta_fns: dict[str, Callable[[], torch.Tensor]] = {}
    meta_out: dict[str, torch.Tensor] = {}
    for variant in a.meta_variants.split(","):
        for meta_act in a.meta_activations.split(","):
            name = f"meta_{variant}_{meta_act}"
            row: dict[str, Any] = {"kernel": name, "variant": variant, "activation": meta_act}
            rows[name] = row
            flags = META_VARIANTS[variant]
            tuner = meta_autotuner(mod, flags.get("enable_persistent", False))
            acts = [meta_act, "silu"] if a.small and meta_act != "silu" else [meta_act]
            for try_act in acts:
                kwargs: dict[str, Any] = dict(
                    query=q_meta,
                    key=k,
                    value=v,
                    query_offset=qo,
                    key_offset=qo,
                    max_seq_len_q=max_len,
                    max_seq_len_kv=max_len,
                    is_causal=False,
                    qk_scale=1.0 / max(max_len, 1),
                    activation=try_act,
                    **flags,
                )
                fn = lambda kw=kwargs: meta_fn(**kw)
                tuner.cache.clear()
                t0 = time.time()
                try:
                    with torch.no_grad():
                        meta_out[name] = fn()
                    sync(cuda)
                except Exception as e:
                    msg = root_cause(e)
                    hint = ""
                    if a.small and try_act == "fast_silu":
                        hint = " (the Triton interpreter has no libdevice fast_expf/fast_dividef)"
                    print(f"{name}: activation {try_act!r} failed: {msg}{hint}", flush=True)
                    row.setdefault("errors", {})[try_act] = msg
                    continue
                row["tune_s"] = time.time() - t0
                row["best_config"] = str(getattr(tuner, "best_config", None))
                row["ran_activation"] = try_act
                # Their op turns TMA off unless the device supports it and BLOCK_D == D (128 here).
                row["tma"] = bool(flags.get("enable_tma")) and bool(mod.is_tma_supported())
                meta_fns[name] = fn
                print(f"{name}: first call {row['tune_s']:.1f} s, {row['best_config']}", flush=True)
                break
            result["rows"] = list(rows.values())
            save()

    # Checks on the first sequences, then Meta against ours on the whole batch.
    sub = (q[:nq], k[:nq], v[:nq])
    r32, r16 = reference(*sub, qo[: n_seq + 1], max_len, None)
    rows["ours"]["check"] = check_row(out_ours, r32, r16, nq)
    m32, m16 = reference(q_meta[:nq], k[:nq], v[:nq], qo[: n_seq + 1], max_len, 1.0)
    for name, out in meta_out.items():
        rows[name]["check"] = check_row(out, r32, r16, nq)
        rows[name]["check_own_inputs"] = check_row(out, m32, m16, nq)
        rows[name]["err_vs_ours"] = rel(out, out_ours)
    for name, row in rows.items():
        if "check" in row:
            ch = row["check"]
            extra = ""
            if "err_vs_ours" in row:
                own = row["check_own_inputs"]
                extra = f"; on its own inputs {own['err']:.2e} | vs ours (all rows) {row['err_vs_ours']:.2e}"
            status = "ok" if ch["ok"] else "FAIL"
            print(
                f"check {name}: vs fp32 ref {ch['err']:.2e} (bf16 ref {ch['ref_err']:.2e}) {status}{extra}",
                flush=True,
            )
    result["rows"] = list(rows.values())
    save()

    # Timing.
    timed = time_interleaved({"ours": ours_fwd, **meta_fns}, a.rounds, a.iters, cuda)
    for name, t in timed.items():
        rows[name].update(t, tflops=fwd_flop / t["ms"] / 1e9)
    for name in meta_fns:
        rows[name]["speedup_ours"] = rows[name]["ms"] / rows["ours"]["ms"]
    print(f"\nforward, median of {a.rounds}x{a.iters} calls | ms | min ms | TF/s | speedup ours/theirs")
    for name, row in rows.items():
        if "ms" not in row:
            print(f"{name} | ERROR {row.get('errors')}")
            continue
        speedup = f"{row['speedup_ours']:.2f}x" if "speedup_ours" in row else "-"
        notes = [f"first call {row['tune_s']:.1f} s"]
        if row.get("ran_activation", row.get("activation")) != row.get("activation"):
            notes.append(f"ran {row['ran_activation']!r}: {row['activation']!r} failed")
        if row.get("variant", "").endswith("tma") and not row.get("tma"):
            notes.append("TMA unsupported here: ran without")
        if "best_config" in row:
            notes.append(row["best_config"])
        print(
            f"{name} | {row['ms']:.3f} | {row['min_ms']:.3f} | {row['tflops']:.1f} | {speedup} "
            f"({'; '.join(notes)})"
        )
    if meta_fns:
        best = min(meta_fns, key=lambda n: rows[n]["ms"])
        s = rows[best]["speedup_ours"]
        verdict = "meets" if s >= 1.1 else "below"
        caveat = " (CPU interpreter: not a performance number)" if a.small else ""
        print(f"ours vs the fastest Meta row ({best}): {s:.2f}x, {verdict} the 1.1x target{caveat}")
        result["best_meta"], result["speedup_vs_best_meta"] = best, s
    result["rows"] = list(rows.values())
    save()
    failed = not meta_fns or any(not r["check"]["ok"] for r in rows.values() if "check" in r)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
