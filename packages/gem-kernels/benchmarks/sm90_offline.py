"""Helpers of the offline sm_90 compile scripts (``compile_sm90.py``, ``block_registers_sm90.py``,
``launches_sm90.py``): the PTX without its debug information, ptxas's resource report of a kernel, and the
compilation of a kernel exactly as a launcher launches it (recorded, not run), with no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

_DEBUG_LINE = re.compile(r"^\s*(\.(loc|file)\b.*|\$L__tmp\d+:\s*)$\n?", re.MULTILINE)


def code_only(ptx: str) -> str:
    """The PTX without its debug information (``.loc``/``.file`` lines, ``$L__tmp`` labels, the DWARF
    sections: they follow the source lines), so that the PTX of two versions of a kernel's source can be
    diffed."""
    cut = re.search(r"^\s*\.section\s+\.debug", ptx, re.MULTILINE)
    return _DEBUG_LINE.sub("", ptx[: cut.start()] if cut else ptx)


def ptxas_usage(ptx: str, maxnreg: int | None = None) -> dict[str, int]:
    """ptxas's resource report of the kernel in ``ptx``: Triton's own ptxas with the flags Triton uses
    (``-lineinfo -v --regAllocOptLevel=2 --gpu-name=<the PTX's target>``), ``--maxrregcount`` when
    ``maxnreg`` is given and the PTX sets none. Keys: regs, spill_st, spill_ld, stack, smem_ptxas (bytes;
    -1 where ptxas printed none). Raises ``subprocess.CalledProcessError`` if ptxas fails."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\s*\.target\s+(\w+)", ptx, re.MULTILINE)
    arch = target.group(1) if target else "sm_90a"
    try:
        found = get_ptxas(90)  # Triton 3.7: by architecture
    except TypeError:
        found = get_ptxas()
    ptxas = found if isinstance(found, str) else found.path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", src + ".o"]
        if maxnreg is not None and ".maxnreg" not in ptx:
            cmd[1:1] = [f"--maxrregcount={maxnreg}"]
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    log = proc.stdout + proc.stderr

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else -1

    return {
        "regs": grab(r"Used (\d+) registers"),
        "spill_st": grab(r"(\d+) bytes spill stores"),
        "spill_ld": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
        "smem_ptxas": max(grab(r"(\d+) bytes smem"), 0),
    }


def usage_line(ptx: str) -> str:
    """``regs N  spill-stores B  spill-loads B`` of :func:`ptxas_usage`, or why ptxas failed."""
    try:
        u = ptxas_usage(ptx)
    except subprocess.CalledProcessError as e:
        return f"ptxas failed: {(e.stdout or '') + (e.stderr or '')}"[-300:]
    return f"regs {u['regs']}  spill-stores {u['spill_st']}B  spill-loads {u['spill_ld']}B"


# Pointer types of tensor arguments, by dtype (Triton's signature strings).
_PTR_TYPES = {
    "torch.float32": "*fp32",
    "torch.bfloat16": "*bf16",
    "torch.float16": "*fp16",
    "torch.uint8": "*u8",
    "torch.int8": "*i8",
    "torch.int32": "*i32",
    "torch.int64": "*i64",
    "torch.bool": "*i1",
}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
Launch = tuple[str, Any, tuple[Any, ...], dict[str, Any]]


def record_launches(label: str, launcher: Callable[[], Any]) -> list[Launch]:
    """The kernel launches ``launcher()`` makes (run it on CPU tensors), as ``(label, kernel, args,
    kwargs)``: ``JITFunction.run`` is patched to record them instead of running them."""
    from triton.runtime.jit import JITFunction

    seen: list[Launch] = []
    original = JITFunction.run

    def fake_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        seen.append((f"{label} #{len(seen)}", self, args, kwargs))

    JITFunction.run = fake_run
    try:
        launcher()
    finally:
        JITFunction.run = original
    return seen


def compile_launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``triton.compile`` of one recorded launch for sm_90: the launch's argument types (tensor dtypes,
    ``i32``/``i64`` ints, ``fp32`` floats), its constexprs and options, and the JIT's divisibility-by-16
    hints of pointers and ints."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

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
        elif hasattr(value, "data_ptr"):
            sig[name] = _PTR_TYPES[str(value.dtype)]
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
    source = ASTSource(fn, sig, consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
