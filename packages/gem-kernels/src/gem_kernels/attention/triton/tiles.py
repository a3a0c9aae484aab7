"""Launch one attention kernel with its blocks: fixed (forced, or the interpreter) or autotuned.

The fixed launch calls the raw ``@triton.jit`` kernel with :func:`..variants.fixed_blocks`; the tuned one
calls its autotuner (:data:`.autotuners.AUTOTUNERS`). Either way a hardware-tanh compile failure
(``FAST_ACT``) is retried once with ``tl.sigmoid`` and remembered for the process
(:func:`fast_act_available`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import triton

from gem_kernels.attention import variants

# Triton objects (kernels, autotuners, configs) are untyped: Any. Constexpr values by name:
Consts = dict[str, Any]
Grid = tuple[int, ...]

_fast_act_ok = True  # cleared if the hardware-tanh activations fail to compile on this GPU/Triton


def fast_act_available() -> bool:
    """False once the hardware-tanh activations failed to compile in this process."""
    return _fast_act_ok


def launch_tiled(
    tuned: Any, raw: Any, grid_of: Callable[[int, int], Grid], args: tuple[Any, ...], consts: Consts
) -> None:
    """Launch ``raw`` with fixed blocks or ``tuned`` (autotuned). ``grid_of(block_m, block_n)`` gives the
    grid; axis 1 counts the tiles of the longest sequence (nothing is launched for an empty grid)."""
    blocks = variants.fixed_blocks()
    if blocks is not None:
        bm, bn = blocks
        if 0 in grid_of(bm, bn):
            return
        raw[grid_of(bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, **consts)
    elif 0 not in grid_of(16, 16):
        _with_fast_act_fallback(
            lambda c: tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **c), consts
        )


def launch_onetile(
    tuned: Any, raw: Any, grid: Grid, args: tuple[Any, ...], consts: Consts, resident: dict[str, int]
) -> None:
    """Launch a one-tile kernel: ``resident`` fixes the block of the short side."""
    blocks = variants.fixed_blocks()
    if blocks is not None:
        bm, bn = blocks
        raw[grid](*args, **{"BLOCK_M": bm, "BLOCK_N": bn, **resident}, **consts)
    else:
        _with_fast_act_fallback(lambda c: tuned[grid](*args, **resident, **c), consts)


def _with_fast_act_fallback(launch: Callable[[Consts], None], consts: Consts) -> None:
    global _fast_act_ok
    try:
        launch(consts)
    except triton.CompilationError:
        if not consts["FAST_ACT"]:
            raise
        _fast_act_ok = False
        warnings.warn("hardware tanh failed to compile; GDPA activations use tl.sigmoid", stacklevel=3)
        launch({**consts, "FAST_ACT": False})
