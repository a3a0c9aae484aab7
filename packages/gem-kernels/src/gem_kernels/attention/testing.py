"""The test seam of the jagged attention kernels: what tests and benchmarks may force, and read back.

    from gem_kernels.attention import testing

    with testing.forced(variant="onetile_split", blocks=(32, 32), chunk=48):
        out = gem_kernels.gdpa(...)          # and its backward, inside the block
    testing.auto_choices()                  # auto's timed choices of this process
    testing.persistent_launches()           # which persistent kernel paths ran (TMA or pointer loads)
    testing.autotuners()["fwd"].persistent  # an autotuner's disk-cache hooks (timings counted)

Users pick a variant with ``GEM_KERNELS_ATTENTION_VARIANT`` (:mod:`.variants`); nothing here is needed to
run the kernels. The readers import the Triton launchers, so only they need Triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from gem_kernels.attention import variants

__all__ = ["auto_choices", "autotuners", "forced", "persistent_launches"]


@contextlib.contextmanager
def forced(
    *,
    variant: str | None = None,
    blocks: tuple[int, int] | None = None,
    chunk: int | None = None,
    tune_in_interpreter: bool | None = None,
) -> Iterator[None]:
    """Force, inside a ``with`` block (forward and backward), what is given; the rest stays as it was.

    Args:
        variant: one of :data:`..variants.VARIANTS` instead of ``GEM_KERNELS_ATTENTION_VARIANT``.
        blocks: ``(BLOCK_M, BLOCK_N)`` (query tile, key tile) of every kernel instead of autotuning (the
            one-tile kernels keep the bucket as their short side's block).
        chunk: rows per chunk of the split one-tile backward (any ``>= 1``, a multiple of the streamed tile
            or not) instead of :data:`..variants.SPLIT_CHUNK`.
        tune_in_interpreter: under ``TRITON_INTERPRET=1``, go through the autotuners and ``auto``'s timing
            as on CUDA (and so the disk cache) instead of fixed blocks.
    """
    if variant is not None and variant not in variants.VARIANTS:
        raise ValueError(f"variant must be one of {variants.VARIANTS}, got {variant!r}")
    if blocks is not None and (len(blocks) != 2 or any(not isinstance(b, int) or b < 1 for b in blocks)):
        raise ValueError(f"blocks must be two positive ints (BLOCK_M, BLOCK_N), got {blocks!r}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk rows must be >= 1, got {chunk}")
    now = variants.overrides()
    new = variants.Overrides(
        variant=now.variant if variant is None else variant,
        blocks=now.blocks if blocks is None else (blocks[0], blocks[1]),
        chunk=now.chunk if chunk is None else chunk,
        tune_in_interpreter=now.tune_in_interpreter if tune_in_interpreter is None else tune_in_interpreter,
    )
    old = variants.replace_overrides(new)
    try:
        yield
    finally:
        variants.replace_overrides(old)


def auto_choices() -> dict[tuple[Any, ...], str]:
    """``auto``'s choices of this process (tiled, onetile or onetile_split), by bucket key (a copy)."""
    from gem_kernels.attention.triton.launch import AUTO_CHOICE

    return dict(AUTO_CHOICE.chosen)


def persistent_launches() -> dict[tuple[str, str], int]:
    """Launches of the persistent kernels so far, by ``(kernel, "tma" | "pointer")`` (a copy)."""
    from gem_kernels.attention.triton.persistent_launch import launches

    return dict(launches)


def autotuners() -> dict[str, Any]:
    """Every attention autotuner by its name in the tuning cache (``fwd``, ``bwd_short_kv``,
    ``persistent_dq``, ...); ``.persistent`` holds its disk-cache hooks (``.persistent.timed``)."""
    from gem_kernels.attention.triton.autotuners import AUTOTUNERS

    return dict(AUTOTUNERS)
