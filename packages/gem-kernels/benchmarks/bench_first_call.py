"""First-call cost of a new shape bucket, without and with the persistent tune cache.

Each case runs in its own fresh process, twice: first with an empty ``GEM_KERNELS_CACHE`` folder and an
empty Triton compile cache (``TRITON_CACHE_DIR``: everything is compiled and every candidate timed), then
in a second fresh process with both folders as the first left them (a restarted job: it reads the tuned
choices and loads only the winners' binaries), and a third like the second that calls
:func:`gem_kernels.prewarm_triton` at start-up, before building its inputs (Triton's per-process source
hash, ~0.37 s on the H200, then runs beside the rest of the start-up). Per case it prints the seconds of
the first forward+backward (inputs on the device, the CUDA context up and the modules a first call
would import lazily -- torch._dynamo, Triton, the kernels -- imported before the clock starts; those
seconds are printed apart), the time of the second call, and how many candidates each autotuner timed.
Targets (issue 19): a new bucket <= 10 s, a cached one <= 0.5 s, fp32 no slower to tune than bf16.

Cases: causal softmax and causal GDPA silu (jagged self-attention, the general shape class), a short-key
cross GDPA silu (where ``auto`` also times the one-tile kernels), and block attention (64) -- in bf16 and
fp32 (exact fp32 products), forward + backward.

On the H200 (the coordinator):
    uv run --no-sync python packages/gem-kernels/benchmarks/bench_first_call.py
and, for the floor of one candidate per kernel (compile the H200's pick only, time nothing):
    uv run --no-sync python packages/gem-kernels/benchmarks/bench_first_call.py --candidates 1 \
        --out first_call_1.json
CPU smoke test of the script itself (interpreter, tiny shapes; the numbers mean nothing):
    TRITON_INTERPRET=1 uv run --no-sync python packages/gem-kernels/benchmarks/bench_first_call.py --small \
        --cases softmax_causal-fp32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CASES = [
    f"{op}-{dt}"
    for op in ("softmax_causal", "silu_causal", "silu_cross", "block64")
    for dt in ("bf16", "fp32")
]


def _child(case: str, small: bool, prewarm: bool) -> dict:
    """Build the case's inputs, then time its first and second forward+backward (this process only).

    With ``prewarm``, :func:`gem_kernels.prewarm_triton` is called first, as a job calls it at start-up."""
    import torch

    torch.set_num_threads(1)
    from gem_kernels import block_attention, gdpa, jagged_flash_attention, prewarm_triton, use_backend

    if prewarm:
        prewarm_triton()
    from gem_kernels.attention import testing

    op, dt = case.split("-")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    heads, dim = (1, 16) if small else (4, 128)
    if op == "block64":
        batch, lo, hi = (3, 1, 90) if small else (128, 800, 2000)
    elif op == "silu_cross":
        batch, lo, hi = (3, 1, 40) if small else (1024, 200, 2000)
    else:
        batch, lo, hi = (3, 1, 90) if small else (64, 256, 4096)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    max_len, total = int(lengths.max()), int(lengths.sum())
    q, k, v, do = (torch.randn(total, heads, dim, generator=g).to(dev, dtype) for _ in range(4))
    offsets = offsets.to(dev)
    if op == "silu_cross":  # user x ad: each sequence attends to 16-64 keys
        kv_len = torch.randint(16, 65, (batch,), generator=g)
        kv_off = torch.cat([torch.zeros(1, dtype=torch.long), kv_len.cumsum(0)]).to(torch.int32).to(dev)
        k, v = (torch.randn(int(kv_len.sum()), heads, dim, generator=g).to(dev, dtype) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step() -> None:
        if op == "block64":
            out = block_attention(q, k, v, offsets, max_seq_len=max_len, block_size=64)
        elif op == "softmax_causal":
            out = jagged_flash_attention(q, k, v, offsets, max_q_len=max_len, causal=True)
        elif op == "silu_causal":
            out = gdpa(q, k, v, offsets, max_q_len=max_len, activation="silu", causal=True)
        else:
            out = gdpa(q, k, v, offsets, kv_off, max_q_len=max_len, max_kv_len=int(kv_len.max()))
        out.backward(do)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    sync()
    # The modules a first call imports lazily (torch._dynamo through the custom ops' disable wrapper,
    # Triton, the kernels): a once-per-process cost that no cache removes, timed apart from the call.
    t0 = time.perf_counter()
    import importlib

    import torch._dynamo

    for mod in ("triton", "gem_kernels.attention.triton.launch", "gem_kernels.block.triton",
                "gem_kernels.attention.triton.persistent_launch"):  # fmt: skip
        importlib.import_module(mod)
    import_s = time.perf_counter() - t0
    profile = None
    if os.environ.get("GEM_FIRST_CALL_PROFILE"):
        import cProfile

        profile = cProfile.Profile()
    with use_backend("triton"):
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        step()
        sync()
        if profile is not None:
            profile.disable()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        step()
        sync()
        second = time.perf_counter() - t0
    tuners = testing.autotuners()
    top = ""
    if profile is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(profile, stream=buf).sort_stats("cumulative").print_stats(30)
        top = buf.getvalue()
    return {
        "case": case,
        "profile": top,
        "import_s": import_s,
        "first_s": first,
        "second_call_s": second,
        "timed": {n: t.persistent.timed for n, t in tuners.items() if t.persistent.timed},
        "variants": {k[0]: v for k, v in testing.auto_choices().items()},
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
    }


def _run_case(case: str, env: dict[str, str], small: bool, timeout: int, prewarm: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case] + (["--small"] if small else [])
    cmd += ["--prewarm"] if prewarm else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        return {"case": case, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.split("JSON:", 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per process")
    p.add_argument("--candidates", type=int, help="GEM_KERNELS_TUNE_CANDIDATES (default: 1 on sm_90, else 2)")
    p.add_argument("--profile", action="store_true", help="cProfile the filled-cache first call (printed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--prewarm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "first_call.json"))
    a = p.parse_args()
    if a.child:
        print("JSON:" + json.dumps(_child(a.child, a.small, a.prewarm)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem-first-call-") as tmp:
        for case in a.cases.split(","):
            # Per case its own empty folders, so no case profits from another's compilations.
            env = dict(os.environ, GEM_KERNELS_CACHE=os.path.join(tmp, case, "gem"),
                       TRITON_CACHE_DIR=os.path.join(tmp, case, "triton"))  # fmt: skip
            if a.candidates:
                env["GEM_KERNELS_TUNE_CANDIDATES"] = str(a.candidates)
            cold = _run_case(case, env, a.small, a.timeout)
            warm_env = dict(env, GEM_FIRST_CALL_PROFILE="1") if a.profile else env
            warm = _run_case(case, warm_env, a.small, a.timeout)
            if warm.get("profile"):
                print(f"{case}: cProfile of the first call with filled caches\n{warm['profile']}", flush=True)
            # A third process, caches filled, that calls prewarm_triton() at start-up as a job would.
            prewarmed = _run_case(case, env, a.small, a.timeout, prewarm=True)
            rows.append(
                {"case": case, "empty_cache": cold, "filled_cache": warm, "filled_cache_prewarmed": prewarmed}
            )
            c, w = cold.get("first_s", float("nan")), warm.get("first_s", float("nan"))
            pw = prewarmed.get("first_s", float("nan"))
            print(
                f"{case:22s} first call, empty cache {c:8.2f} s (target <= 10)   "
                f"filled cache {w:7.3f} s, with prewarm_triton() at start-up {pw:7.3f} s (target <= 0.5)   "
                f"lazy imports before the clock "
                f"{cold.get('import_s', float('nan')):.2f} / {warm.get('import_s', float('nan')):.2f} s   "
                f"second (warm) call {warm.get('second_call_s', float('nan')) * 1e3:.2f} ms   "
                f"timed {cold.get('timed', cold.get('error'))} "
                f"then {warm.get('timed', warm.get('error'))}   variants {cold.get('variants')}",
                flush=True,
            )
            if a.out:  # after every case: a run cut short keeps what it measured
                with open(a.out, "w") as f:
                    json.dump({"rows": rows, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
