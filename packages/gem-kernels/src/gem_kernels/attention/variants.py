"""Which attention implementation runs, with which tiles: the one place that decides.

Implementations (variants) of the Triton path, by shape class of the bucket (:func:`shape_class`):

- ``tiled``: the general kernels (:mod:`.triton.fwd`, :mod:`.triton.bwd`), one program per (sequence x
  head, tile of the longest sequence); every shape class.
- ``onetile``: for short keys (``short_kv``, cross-attention) and few queries (``few_q``, PMA), one program
  per sequence and head with the short side in registers (:mod:`.triton.onetile`): the forward of
  ``short_kv`` and the fused backward of both; ``onetile_split`` is the same with the backward's long side
  cut into chunks of :data:`SPLIT_CHUNK` rows (:mod:`.triton.split`).
- ``tma``: the persistent-grid kernels with TMA loads (:mod:`.triton.persistent_launch`), every class.
- ``auto`` (the default): on sm_90 the general class takes ``tma`` where :func:`auto_persistent_variant`
  says it measured faster; elsewhere, where a one-tile kernel applies, the first call of each bucket times
  the implementations that apply (each autotuned) and keeps the fastest (:class:`AutoChoice`).

``GEM_KERNELS_ATTENTION_VARIANT`` picks one for the process (a user setting, documented in the README).
Blocks: each kernel is autotuned over a few candidates (:data:`CANDIDATES`, :func:`candidates_for`) keyed
on bucketed shapes, except under ``TRITON_INTERPRET=1``, where fixed blocks run (:func:`fixed_blocks`).
Both kinds of choice persist on disk through :mod:`gem_kernels.tune_cache`, the package's one tuning
cache.

Tests and benchmarks override the variant, the blocks and the split chunk through
:mod:`gem_kernels.attention.testing`, which writes :func:`overrides` here.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from gem_kernels import tune_cache
from gem_kernels.dispatch import triton_interpreted

ENV = "GEM_KERNELS_ATTENTION_VARIANT"
VARIANTS = ("auto", "tiled", "onetile", "onetile_split", "tma")
DEFAULT_VARIANT = os.environ.get(ENV, "auto")
if DEFAULT_VARIANT not in VARIANTS:
    raise ValueError(f"{ENV} must be one of {VARIANTS}, got {DEFAULT_VARIANT!r}")

SHORT_KV = 64  # cross-attention with at most this many keys per sequence
FEW_Q = 32  # PMA-style pooling with at most this many queries per sequence
# Rows of the long side per program of the split one-tile backward, per shape class: queries for short_kv
# (cross), keys for few_q (PMA). A multiple of every candidate tile (64, 128). Sequences of at most this
# many rows are one chunk and write their gradients directly. At the benchmark's shapes (B=1024, H=4,
# D=128) 1024 splits half the sequences (cross: queries 1-2000, longest program 1024 rows instead of 1999;
# PMA: keys log-normal <= 4096, 1024 instead of 4096). The fp32 partials (written and read back once) and
# the short side's reloads per extra chunk add 0.38 GB to cross's 3.41 GB least backward traffic (+11%; +7%
# of fwd+bwd) and 0.24 GB to PMA's 5.99 (+4%; +3%); chunks of 512 would add 26% and 9%. On an H100 the
# split backward lost to the whole-stream one by 1-4% (BENCHMARKS.md): ``auto`` times it, and never took it.
SPLIT_CHUNK = {"short_kv": 1024, "few_q": 1024}
INTERPRETER_BLOCKS = (32, 32)  # (BLOCK_M, BLOCK_N) under TRITON_INTERPRET=1 unless forced


@dataclass(frozen=True)
class Overrides:
    """What tests and benchmarks force (:func:`gem_kernels.attention.testing.forced`); None: not forced.

    ``variant``: instead of :data:`DEFAULT_VARIANT`. ``blocks``: ``(BLOCK_M, BLOCK_N)`` of every kernel
    (queries x keys; the one-tile kernels' resident side stays the bucket's). ``chunk``: rows per chunk of the
    split backward instead of :data:`SPLIT_CHUNK`. ``tune_in_interpreter``: under ``TRITON_INTERPRET=1``, go
    through the autotuners and the ``auto`` timing as on CUDA (and so the disk cache)."""

    variant: str | None = None
    blocks: tuple[int, int] | None = None
    chunk: int | None = None
    tune_in_interpreter: bool = False


# Module state like gem_kernels.dispatch's backend (not a ContextVar: the autograd engine runs CUDA
# backwards in its own thread, which must see what the forward saw). Written only by testing.forced.
_overrides = Overrides()


def overrides() -> Overrides:
    """The overrides in force (all None outside :func:`gem_kernels.attention.testing.forced`)."""
    return _overrides


def replace_overrides(new: Overrides) -> Overrides:
    """Put ``new`` in force and return the previous overrides (for :mod:`gem_kernels.attention.testing`)."""
    global _overrides
    old, _overrides = _overrides, new
    return old


def shape_class(bucket_q: int, bucket_kv: int) -> str:
    """``"short_kv"`` (keys bucketed to <= :data:`SHORT_KV`), ``"few_q"`` (queries <= :data:`FEW_Q`) or
    ``"general"``."""
    if bucket_kv <= SHORT_KV:
        return "short_kv"
    if bucket_q <= FEW_Q:
        return "few_q"
    return "general"


def split_chunk(kind: str) -> int:
    """Rows per chunk of the split backward of shape class ``kind`` (forced or :data:`SPLIT_CHUNK`)."""
    return _overrides.chunk or SPLIT_CHUNK[kind]


def fixed_blocks(tunable_in_interpreter: bool = True) -> tuple[int, int] | None:
    """``(BLOCK_M, BLOCK_N)`` when blocks are fixed (forced, or the interpreter unless it tunes), else None
    (autotune). The persistent kernels never tune in the interpreter (``tunable_in_interpreter=False``)."""
    if _overrides.blocks is not None:
        return _overrides.blocks
    tunes = tunable_in_interpreter and _overrides.tune_in_interpreter
    return INTERPRETER_BLOCKS if triton_interpreted() and not tunes else None


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address every ``[T, H, d]`` tensor as ``[T, H*d]`` rows: compute
    capability >= 9 (or the interpreter, which emulates descriptors), ``d`` a power of two >= 16, heads
    packed in rows (``stride(1) == d``), 16-byte aligned rows."""
    if not triton_interpreted():
        dev = tensors[0].device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9:
            return False
    for t in tensors:
        d, es = t.shape[2], t.element_size()
        if d < 16 or d & (d - 1) or t.stride(2) != 1 or t.stride(1) != d:
            return False
        if (t.stride(0) * es) % 16 or t.data_ptr() % 16:
            return False
    return True


def auto_persistent_variant(
    direction: str,
    kind: str,
    band_kind: int,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    tma_ok: bool,
) -> str | None:
    """``"tma"`` where ``auto`` runs the persistent TMA kernels instead of the tiled ones, else None.

    ``direction`` is "fwd" or "bwd"; ``kind`` the :func:`shape_class`; ``band_kind`` 0 for no mask, 1 causal,
    2 a window; ``capability`` the CUDA device's (None off CUDA or under the interpreter); ``tma_ok`` whether
    :func:`tma_supported` holds for the tensors. The rule is what the H200 measured (2026-12-04, B=64
    log-normal lengths <= 4096, H=4, D=128, bf16, same run; BENCHMARKS.md): the TMA forward won everywhere
    (causal softmax 0.612 against 0.678 ms, GDPA silu 0.883 against 1.142), the TMA backward won without a
    mask (GDPA silu 2.71 against 3.53 ms) and lost with the causal band (2.25 against 2.15), so a masked
    backward keeps the tiled kernels. Windowed forwards were not timed alone but end to end: in gem-train's
    base-h200 step (one causal and three window-256 layers take the TMA forward) 130.7 ms against 138.6
    with the tiled kernels. Only sm_90 (where it was measured), 16-bit inputs (the fp32 tiles were not
    timed) and the general class (cross/PMA have one-tile kernels).
    """
    if capability != (9, 0) or not tma_ok or kind != "general":
        return None
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if direction == "bwd" and band_kind != 0:
        return None
    return "tma"


def resolve_variant(
    direction: str, q: torch.Tensor, buckets: tuple[int, int, int, int], *tensors: torch.Tensor
) -> str:
    """The forced or default variant of one call, with ``auto`` turned into ``"tma"`` where that wins.

    ``buckets`` is ``(batch, longest query, longest key, band kind)`` as the launcher buckets them;
    ``tensors`` are those the TMA kernels would load."""
    variant = _overrides.variant or DEFAULT_VARIANT
    if variant != "auto" or triton_interpreted() or q.device.type != "cuda":
        return variant
    kind = shape_class(buckets[1], buckets[2])
    capability = torch.cuda.get_device_capability(q.device)
    tma_ok = tma_supported(*tensors)
    return auto_persistent_variant(direction, kind, buckets[3], q.dtype, capability, tma_ok) or variant


# ------------------------------------------------------------------------------------------ candidates

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

# Candidates of the tiled kernels per kernel and shape class. BLOCK_M tiles the queries and BLOCK_N the keys
# in every kernel ("short_kv": one key tile per sequence, many query rows per program; "few_q": one query
# tile per sequence, long key tiles); the dK/dV kernel's outer tile is BLOCK_N. Two per class and kernel,
# the H200's pick first (BENCHMARKS.md runs B and C), since a first call pays one compilation (~2 s) per
# candidate; key tiles longer than the keys' bucket are pruned.
CANDIDATES: dict[str, dict[str, list[Tile]]] = {
    "fwd": {
        "general": [(128, 64, 8, 3), (128, 128, 8, 3)],
        "short_kv": [(128, 16, 4, 3), (128, 64, 4, 3)],
        "few_q": [(32, 64, 4, 3), (32, 128, 4, 3)],
    },
    "dq": {
        "general": [(128, 64, 8, 3), (64, 64, 4, 3)],
        "short_kv": [(128, 16, 4, 3), (128, 64, 8, 3)],
        "few_q": [(32, 64, 4, 3), (32, 128, 4, 3)],
    },
    "dkdv": {
        "general": [(64, 128, 8, 3), (32, 128, 4, 4)],
        "short_kv": [(32, 64, 4, 4), (128, 16, 4, 3)],
        "few_q": [(32, 64, 4, 3), (32, 128, 4, 3)],
    },
}
# fp32 inputs: twice the bytes per tile and, with exact products, FMA dots whose unrolled code grows with
# BLOCK_M * BLOCK_N / threads (a 128x128 fp32 tile took minutes to compile, or failed for shared memory
# after compiling). Small tiles, two stages, 8 warps (half the FMAs per thread of 4: the general class's
# three kernels compiled for sm_90 in 17 s against 88 s with 4 warps and 9 s for bf16's picks, on the
# 2-core CPU machine), and only the first that fits is compiled: nothing to time.
CANDIDATES_FP32: dict[str, dict[str, list[Tile]]] = {
    "fwd": {
        "general": [(64, 32, 8, 2)],
        "short_kv": [(64, 32, 8, 2), (64, 16, 8, 2)],
        "few_q": [(32, 64, 8, 2), (16, 64, 8, 2)],
    },
    "dq": {
        "general": [(64, 32, 8, 2)],
        "short_kv": [(64, 32, 8, 2), (64, 16, 8, 2)],
        "few_q": [(32, 64, 8, 2), (16, 64, 8, 2)],
    },
    "dkdv": {
        "general": [(32, 64, 8, 2)],
        "short_kv": [(32, 64, 8, 2), (32, 32, 8, 2), (64, 16, 8, 2)],
        "few_q": [(32, 64, 8, 2), (16, 64, 8, 2)],
    },
}
# One-tile kernels: (streamed tile, warps, stages); the resident tile is the bucket of the short side.
FWD_SHORT_KV_CANDIDATES = [(128, 8, 3), (128, 4, 3)]
# Backward: first the H200's pick (64, 4 warps, 3 stages), which spills at 255 registers on sm_90 (ptxas,
# bf16 D=128 silu: short_kv 584 B, few_q 320 B). 8 warps on the same tile spill far less (48 B; few_q
# none, 214 registers) and double the warps per SM (the 4-warp kernels' 139-164 KB of shared memory already
# allow one program per SM): second, not yet timed (GEM_KERNELS_TUNE_CANDIDATES=2 or 3 on sm_90 times
# them). short_kv's former (128, 8, 3) needs 262-296 KB of shared memory: it cannot launch on sm_90, so it
# is gone; few_q's fits (196 KB, spills 468 B) and stays third. `compile_sm90.py onetile --regs` prints
# these figures. The split kernels take the same candidates as their whole-stream versions.
SHORT_KV_BWD_CANDIDATES = [(64, 4, 3), (64, 8, 3)]
FEW_Q_BWD_CANDIDATES = [(64, 4, 3), (64, 8, 3), (128, 8, 3)]
# Persistent TMA kernels: the outer tile is fixed (the tile schedule depends on it), the autotuner picks
# (inner tile, warps, stages); the inner tile is BLOCK_N for fwd/dq, BLOCK_M for dkdv. First: the H200's
# pick (2026-12-04, B=64 log-normal, H=4, D=128, bf16: fwd 64 for GDPA silu and 128 for causal softmax, dq
# 64 and dkdv 64 for both, all 8 warps, 3 stages).
PERSISTENT_OUTER_TILE = 128  # query tile of the forward and dQ kernels, key tile of the dK/dV kernel
PERSISTENT_CANDIDATES = {
    "fwd": [(64, 8, 3), (128, 8, 3), (64, 4, 3), (128, 8, 2)],
    "dq": [(64, 8, 3), (32, 4, 4), (64, 4, 3)],
    "dkdv": [(64, 8, 3), (32, 4, 4), (64, 4, 3)],
}


def smem_bytes(kernel: str, bm: int, bn: int, stages: int, block_d: int, block_dv: int, elsize: int) -> int:
    """Upper estimate of a tiled kernel's shared memory: its resident tile(s) once, the streamed tiles once
    per pipeline stage (fwd: Q resident, K and V streamed; dQ: Q and dO resident; dK/dV: K and V resident,
    Q and dO streamed)."""
    row = (block_d + block_dv) * elsize
    resident, streamed = {
        "fwd": (bm * block_d * elsize, bn * row),
        "dq": (bm * row, bn * row),
        "dkdv": (bn * row, bm * row),
    }[kernel]
    return resident + stages * streamed


def candidates_for(
    kernel: str,
    bucket_q: int,
    bucket_kv: int,
    dtype: torch.dtype,
    block_d: int,
    block_dv: int,
    smem_limit: int | None,
) -> list[Tile]:
    """The (BLOCK_M, BLOCK_N, warps, stages) of tiled ``kernel`` worth compiling for a bucket: those of its
    shape class and dtype class, with key tiles no longer than the keys' bucket and tiles that fit shared
    memory (pruned here rather than compiled and found too big). Never empty; at most
    :func:`gem_kernels.tune_cache.tune_candidates` (one for fp32)."""
    fp32 = dtype == torch.float32
    cands = (CANDIDATES_FP32 if fp32 else CANDIDATES)[kernel][shape_class(bucket_q, bucket_kv)]
    elsize = 4 if fp32 else 2
    fits = [
        c
        for c in cands
        if smem_limit is None or smem_bytes(kernel, c[0], c[1], c[3], block_d, block_dv, elsize) <= smem_limit
    ]
    kept = [c for c in fits if c[1] <= max(bucket_kv, 16)]
    kept = kept or fits[-1:] or [min(cands, key=lambda c: c[0] * c[1])]
    return kept[:1] if fp32 else kept[: tune_cache.tune_candidates()]


# ------------------------------------------------------------------------------------------ the auto choice


class AutoChoice:
    """``auto``'s choice among the implementations of one bucket, timed on its first call.

    :meth:`run` times each implementation that applies once per key and keeps the fastest, in memory and on
    disk (:func:`gem_kernels.tune_cache.choose`: a new process reads the choice and compiles only the
    winner). The candidates' names and kernels are part of the disk key, so a choice stored when there were
    two candidates (before ``onetile_split``) is not read for three: the bucket is timed once more."""

    def __init__(self) -> None:
        self._chosen: dict[tuple[Any, ...], str] = {}

    @property
    def chosen(self) -> Mapping[tuple[Any, ...], str]:
        """The choices of this process so far, by key (read-only)."""
        return MappingProxyType(self._chosen)

    def run(
        self,
        variant: str,
        key: tuple[Any, ...],
        kernels: Sequence[Any],
        device: torch.device,
        tiled: Callable[[], None],
        onetile: Callable[[], None],
        split: Callable[[], None] | None = None,
    ) -> None:
        """Run ``tiled``, ``onetile`` or ``split`` (callables that launch; ``split`` only where a split
        kernel exists, else ``onetile_split`` runs ``onetile``) per ``variant`` (:func:`resolve_variant`'s).
        ``"auto"`` on CUDA (or tuning in the interpreter) times each once per ``key``; under the interpreter
        it runs ``onetile``."""
        launches = {"tiled": tiled, "onetile": onetile, "onetile_split": split or onetile}
        if variant != "auto" or (triton_interpreted() and not _overrides.tune_in_interpreter):
            launches.get(variant, onetile)()
            return
        if key not in self._chosen:
            timers = {"tiled": _timer(tiled), "onetile": _guarded("one-tile", onetile)}
            if split is not None:
                timers["onetile_split"] = _guarded("split one-tile", split)
            self._chosen[key], _ = tune_cache.choose(key, kernels, timers, device)
        launches[self._chosen[key]]()


def _timer(launch: Callable[[], None]) -> Callable[[], float]:
    def run() -> float:
        launch()  # compile and autotune first
        return float(tune_cache.default_bench(launch, (0.5,))[0])

    return run


def _guarded(name: str, launch: Callable[[], None]) -> Callable[[], float]:
    def run() -> float:
        try:
            return _timer(launch)()
        except Exception as e:  # a kernel this GPU/Triton cannot build: keep the others
            warnings.warn(
                f"{name} attention kernel unavailable ({type(e).__name__}: {e}); timing the others",
                stacklevel=5,
            )
            return float("inf")

    return run
