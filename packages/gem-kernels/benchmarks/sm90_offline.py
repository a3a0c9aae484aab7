"""Helpers of the offline sm_90 compile scripts (``compile_sm90.py``, ``block_registers_sm90.py``): the PTX
without its debug information, and ptxas's resource report of a kernel, with no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

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
