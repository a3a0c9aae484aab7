"""Compiles every Triton kernel of gem-precision for sm_90 (Hopper) as its launchers launch it, offline.

Each launcher (``to_mx_triton``, ``mx_mm_triton``, ``dequantize_triton``, ``quantize_rowwise_triton``,
``quantize_tiles_triton``, ``quantize_packed_triton``, ``dequantize_packed_triton``) runs on CPU tensors with
the kernels' launches recorded instead of run (``JITFunction.run`` patched); each recorded launch is compiled
with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``: the launch's argument types (tensor dtypes,
``i32``/``i64`` ints, ``fp32`` floats), its constexprs, ``num_warps``/``num_stages``, and the JIT's
divisibility-by-16 hints. Launchers run with ``TRITON_INTERPRET`` unset, so they pick their GPU tiles and the
hardware FP8 cast. Prints one line per kernel (shared memory, registers and spills from Triton's ptxas with
``--regs``); ``--ptx-dir DIR`` writes each kernel's PTX without debug information (``.loc``/``.file`` lines,
``$L__tmp`` labels, the DWARF sections), so that a change of the kernels' source or layout can be shown to
leave the generated code as it was (``diff -r BEFORE AFTER``).

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-precision/benchmarks/compile_sm90.py [--ptx-dir DIR] [--regs]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("run without TRITON_INTERPRET: the launchers must take their GPU settings")

from gem_precision.formats import E4M3, E5M2
from gem_precision.mx import to_mx
from gem_precision.mx import triton as mx_triton
from gem_precision.packed import packed_width
from gem_precision.packed import triton as packed_triton
from gem_precision.rowwise import triton as rowwise_triton

_PTR_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.uint8: "*u8",
    torch.int8: "*i8",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
_DEBUG_LINE = re.compile(r"^\s*(\.(loc|file)\b.*|\$L__tmp\d+:\s*)$\n?", re.MULTILINE)
Launch = tuple[str, Any, tuple[Any, ...], dict[str, Any]]


def record(label: str, launcher: Callable[[], Any]) -> list[Launch]:
    """The launches ``launcher()`` makes, as ``(label, kernel, args, kwargs)``, none of them run."""
    seen: list[Launch] = []
    original = JITFunction.run

    def fake_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        seen.append((f"{label} #{len(seen)}", self, args, kwargs))

    JITFunction.run = fake_run  # type: ignore[method-assign]
    try:
        launcher()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return seen


def compile_launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``triton.compile`` of one recorded launch for sm_90."""
    names = list(fn.arg_names)
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k not in _OPTIONS}
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(names):
        value = bound[name]
        if name in constexpr:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = _PTR_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return triton.compile(
        ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=options
    )


def code_only(ptx: str) -> str:
    """The PTX without its debug information (which follows the source lines)."""
    cut = re.search(r"^\s*\.section\s+\.debug", ptx, re.MULTILINE)
    return _DEBUG_LINE.sub("", ptx[: cut.start()] if cut else ptx)


def ptxas_line(ptx: str) -> str:
    """Registers and spills from the ptxas that ships with Triton (Triton's flags)."""
    from triton.backends.nvidia.compiler import get_ptxas

    found = get_ptxas(90) if "arch" in get_ptxas.__code__.co_varnames else get_ptxas()
    ptxas = found if isinstance(found, str) else found.path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o", src + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return f"regs {regs[1] if regs else '?'}  spills {spill[1] + '/' + spill[2] if spill else '?'}"


def launches() -> list[Launch]:
    """Every kernel at representative settings: the MX quantizer in each layout (nearest and stochastic,
    rceil and floor, E4M3 and E5M2, with a Hadamard transform), the GEMM's two variants, the dequantizer
    (blocked along either axis, square), the row-wise quantizer, the tiled two-pass column quantizer (with
    and without the row-wise copy), the legacy column kernels, and the packed-row quantizers and dequantizer
    of the 8-bit all-gather (fp32 master shards in, bf16 weights out)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).to(torch.bfloat16)
    h = torch.eye(32)
    out: list[Launch] = []
    for axis, square in ((-1, False), (0, False), (-1, True)):
        for fmt, mode, seed in (
            (E4M3, "rceil", None),
            (E4M3, "floor", None),
            (E5M2, "rceil", 7),
            (E4M3, "rceil", 7),
        ):
            out += record(
                f"to_mx axis={axis} square={square} {fmt.dtype} {mode} stochastic={seed is not None}",
                lambda axis=axis, square=square, fmt=fmt, mode=mode, seed=seed: mx_triton.to_mx_triton(
                    x,
                    axis=axis,
                    block_size=32,
                    fmt=fmt,
                    scale_mode=mode,
                    seed=seed,
                    square=square,
                    hadamard=None,
                ),
            )
    out += record(
        "to_mx hadamard",
        lambda: mx_triton.to_mx_triton(
            x, axis=-1, block_size=32, fmt=E4M3, scale_mode="rceil", seed=None, square=False, hadamard=h
        ),
    )
    qa = to_mx(x.float(), backend="reference")
    qw = to_mx(torch.randn(128, 512, generator=g), axis=-1, square=True, backend="reference")
    for bf16_dot in (True, False):
        out += record(
            f"mx_mm fused bf16_dot={bf16_dot}",
            lambda bf16_dot=bf16_dot: mx_triton.mx_mm_triton(
                qa, qw.t(), out_dtype=torch.float32, bf16_dot=bf16_dot, path="fused"
            ),
        )
    for name, q in (("axis1", qa), ("axis0", qa.t()), ("square", qw)):
        out += record(f"dequantize {name}", lambda q=q: mx_triton.dequantize_triton(q, torch.bfloat16))
    for fmt in (E4M3, E5M2):
        out += record(
            f"rowwise {fmt.dtype}",
            lambda fmt=fmt: rowwise_triton.quantize_rowwise_triton(x, fmt, transpose=False),
        )
        out += record(
            f"tiles col {fmt.dtype}",
            lambda fmt=fmt: rowwise_triton.quantize_tiles_triton(x, fmt, col_k_multiple=16),
        )
        out += record(
            f"tiles col+row {fmt.dtype}",
            lambda fmt=fmt: rowwise_triton.quantize_tiles_triton(x, fmt, col_k_multiple=16, row_fmt=E4M3),
        )
        out += record(
            f"legacy col {fmt.dtype}",
            lambda fmt=fmt: rowwise_triton.quantize_rowwise_triton(
                x, fmt, transpose=True, k_multiple=16, col_impl="legacy"
            ),
        )
    w = torch.randn(256, 512, generator=g)
    for fmt in ("fp8", "mxfp8"):
        width = packed_width(512, fmt)
        out += record(
            f"pack {fmt}",
            lambda fmt=fmt, width=width: packed_triton.quantize_packed_triton(w, fmt, width),
        )
        packed = torch.zeros(256, width, dtype=torch.uint8)
        out += record(
            f"unpack {fmt}",
            lambda fmt=fmt, packed=packed: packed_triton.dequantize_packed_triton(
                packed, 512, fmt, torch.empty(256, 512, dtype=torch.bfloat16)
            ),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx-dir", help="write each kernel's PTX without debug information here")
    ap.add_argument("--regs", action="store_true", help="registers and spills (ptxas)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90", flush=True)
    for label, fn, args, kwargs in launches():
        name = f"{label} {fn.__name__}"
        try:
            k = compile_launch(fn, args, kwargs)
        except Exception as e:
            print(f"{name}: FAIL {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        ptx = k.asm["ptx"]
        if a.ptx_dir:
            os.makedirs(a.ptx_dir, exist_ok=True)
            with open(os.path.join(a.ptx_dir, re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".ptx"), "w") as f:
                f.write(code_only(ptx))
        extra = f"  {ptxas_line(ptx)}" if a.regs else ""
        print(f"{name}: ok  smem {k.metadata.shared}{extra}", flush=True)


if __name__ == "__main__":
    main()
