"""Launchers of the jagged attention Triton kernels: output allocation, grids, block sizes, autotuning.

On CUDA each kernel is autotuned over a few block shapes, keyed on bucketed shapes (batch to a power of
two, the longest query/key sequence to a power of two, the band kind, the activation and head dims), so
ragged batches do not retune every step. Which candidates are tried depends on the shape class: short
keys (cross-attention, <= 64 keys: ``short_kv``), few queries (PMA, <= 32: ``few_q``), or ``general``.

For the two asymmetric classes there is a second implementation (:mod:`.attention_onetile`: one program per
sequence and head, the short side in registers, the long side streamed): the forward of ``short_kv`` and
the fused backward of ``short_kv`` and ``few_q``; the backward also comes split (``onetile_split``: the long
side cut into chunks of :data:`SPLIT_CHUNK` rows, one program per chunk and head, and a small pass that
sums the chunks' fp32 partials of the short side's gradient). ``GEM_KERNELS_ATTENTION_VARIANT`` (or
:func:`force_variant`) picks ``tiled``, ``onetile``, ``onetile_split`` (the split backward, the one-tile
forward), or ``auto`` (the default): on CUDA the first call of each bucket times every implementation that
applies (each autotuned) and keeps the fastest, like an autotuner over kernels.
On Hopper, ``auto`` also runs the general shape class on the persistent TMA kernels
(:mod:`.attention_persistent_launch`) where they measured faster: see :func:`auto_persistent_variant`;
``tma`` forces them for every shape class.

Both kinds of choice persist across processes (:mod:`gem_kernels.tune_cache`: ``~/.cache/gem/kernels``,
``GEM_KERNELS_CACHE``), and only a few candidates per shape and dtype class are compiled at all
(:func:`candidates_for`), so a new bucket costs a few compilations and a cached one none but the winner's.

Under ``TRITON_INTERPRET=1`` (CPU tests) fixed blocks run; tests force blocks with :func:`force_blocks`
and implementations with :func:`force_variant`, or tune as on CUDA with :func:`tune_in_interpreter`.
"""

# fmt: off
# (Launch argument tuples stay packed: one argument per line would bury the logic.)

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton

from gem_kernels import tune_cache
from gem_kernels.dispatch import triton_interpreted
from gem_kernels.torch_ops.activations import ACTIVATION_IDS
from gem_kernels.triton_kernels.attention_bwd import dkdv_kernel, dq_kernel
from gem_kernels.triton_kernels.attention_fwd import fwd_kernel
from gem_kernels.triton_kernels.attention_onetile import (
    bwd_few_q_kernel,
    bwd_few_q_split_kernel,
    bwd_short_kv_kernel,
    bwd_short_kv_split_kernel,
    fwd_short_kv_kernel,
    sum_chunk_partials_kernel,
)
from gem_kernels.tune_cache import tune_candidates

# Triton objects (kernels, autotuners, configs) are untyped: Any. Constexpr values by name:
Consts = dict[str, Any]
Grid = tuple[int, ...]

# Stands for an unbounded side of the band; small enough that ``i + UNBOUNDED`` fits in int32.
UNBOUNDED = 1 << 30
SHORT_KV = 64  # cross-attention with at most this many keys per sequence
FEW_Q = 32  # PMA-style pooling with at most this many queries per sequence

# Candidates per kernel timed on a new bucket: :func:`gem_kernels.tune_cache.tune_candidates`.
_forced: tuple[int, int] | None = None
_tune_interpreted = False  # tests: autotune (and choose variants) under the interpreter too
_forced_variant: str | None = None
_forced_chunk: int | None = None
# Rows of the long side per program of the split one-tile backward, per shape class: queries for short_kv
# (cross), keys for few_q (PMA). A multiple of every candidate tile (64, 128). Sequences of at most this
# many rows are one chunk and write their gradients directly. Chosen, not yet timed: at the benchmark's
# shapes (B=1024, H=4, D=128) 1024 splits half the sequences (cross: queries 1-2000, longest program 1024 rows
# instead of 1999; PMA: keys log-normal <= 4096, 1024 instead of 4096). The fp32 partials (written and read
# back once) and the short side's reloads per extra chunk add 0.38 GB to cross's 3.41 GB least backward
# traffic (+11%; +7% of fwd+bwd) and 0.24 GB to PMA's 5.99 (+4%; +3%); chunks of 512 would add 26% and 9%.
SPLIT_CHUNK = {"short_kv": 1024, "few_q": 1024}
# "tma": the persistent-grid kernels with TMA loads (:mod:`.attention_persistent_launch`); "auto" takes it
# where :func:`auto_persistent_variant` says it wins. (The variants auto never picked, "single_pass",
# "persistent" and "tma_ws", were removed: BENCHMARKS.md, "Removed variants".)
PERSISTENT_VARIANTS = ("tma",)
VARIANTS = ("tiled", "onetile", "onetile_split", "auto", *PERSISTENT_VARIANTS)
# "auto": where a one-tile kernel applies, time it (and the split backward) against the tiled kernels once
# per bucket and keep the fastest (on the H200 the one-tile kernels won the cross forward and backward and
# the PMA backward; the split backward is not timed yet).
DEFAULT_VARIANT = os.environ.get("GEM_KERNELS_ATTENTION_VARIANT", "auto")
if DEFAULT_VARIANT not in VARIANTS:
    raise ValueError(f"GEM_KERNELS_ATTENTION_VARIANT must be one of {VARIANTS}, got {DEFAULT_VARIANT!r}")


def auto_persistent_variant(
    direction: str, kind: str, band_kind: int, dtype: torch.dtype, capability: tuple[int, int] | None,
    tma_ok: bool,
) -> str | None:
    """The persistent variant ``auto`` runs instead of the tiled kernels, or None (keep them).

    ``direction`` is "fwd" or "bwd"; ``kind`` the :func:`shape_class`; ``band_kind`` 0 for no mask, 1 causal,
    2 a window; ``capability`` the CUDA device's (None off CUDA or under the interpreter); ``tma_ok`` whether
    :func:`.attention_persistent_launch.tma_supported` holds for the tensors. The rule is what the H200
    measured (2026-12-04, B=64 log-normal lengths <= 4096, H=4, D=128, bf16, same run; BENCHMARKS.md):
    the TMA forward won everywhere (causal softmax 0.612 against 0.678 ms, GDPA silu 0.883 against 1.142),
    the TMA backward won without a mask (GDPA silu 2.71 against 3.53 ms) and lost with the causal band
    (2.25 against 2.15), so a masked backward keeps the tiled kernels. Windowed forwards were not timed
    alone but end to end: in gem-train's base-h200 step (one causal and three window-256 layers take the
    TMA forward) 130.7 ms against 138.6 with the tiled kernels. Only sm_90 (where it was measured),
    16-bit inputs (the fp32 tiles were not timed) and the general class (cross/PMA have one-tile kernels).
    """
    if capability != (9, 0) or not tma_ok or kind != "general":
        return None
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if direction == "bwd" and band_kind != 0:
        return None
    return "tma"


def _resolved_variant(
    direction: str, q: torch.Tensor, buckets: tuple[int, int, int, int], *tensors: torch.Tensor
) -> str:
    """The forced or default variant, with ``auto`` turned into a persistent one where it wins."""
    variant = _forced_variant or DEFAULT_VARIANT
    if variant != "auto" or triton_interpreted() or q.device.type != "cuda":
        return variant
    from gem_kernels.triton_kernels.attention_persistent_launch import tma_supported

    kind = shape_class(buckets[1], buckets[2])
    capability = torch.cuda.get_device_capability(q.device)
    tma_ok = tma_supported(*tensors)
    return auto_persistent_variant(direction, kind, buckets[3], q.dtype, capability, tma_ok) or variant


@contextlib.contextmanager
def force_blocks(block_m: int, block_n: int) -> Iterator[None]:
    """Run every kernel with ``BLOCK_M`` (query tile) and ``BLOCK_N`` (key tile) fixed (tests)."""
    global _forced
    old, _forced = _forced, (block_m, block_n)
    try:
        yield
    finally:
        _forced = old


@contextlib.contextmanager
def tune_in_interpreter() -> Iterator[None]:
    """Under ``TRITON_INTERPRET=1``, go through the autotuners and the ``auto`` variant choice as on CUDA
    (and so the persistent cache) instead of fixed blocks (tests)."""
    global _tune_interpreted
    old, _tune_interpreted = _tune_interpreted, True
    try:
        yield
    finally:
        _tune_interpreted = old


@contextlib.contextmanager
def force_chunk(rows: int) -> Iterator[None]:
    """Cut the long side of the split one-tile backward into chunks of ``rows`` rows (tests; any ``rows >=
    1``, a multiple of the streamed tile or not) instead of :data:`SPLIT_CHUNK`."""
    global _forced_chunk
    if rows < 1:
        raise ValueError(f"chunk rows must be >= 1, got {rows}")
    old, _forced_chunk = _forced_chunk, rows
    try:
        yield
    finally:
        _forced_chunk = old


def _fixed_blocks() -> bool:
    return _forced is not None or (triton_interpreted() and not _tune_interpreted)


@contextlib.contextmanager
def force_variant(name: str) -> Iterator[None]:
    """Use ``"tiled"`` (the general kernels), ``"onetile"`` where it applies, ``"onetile_split"`` (the same,
    with the split backward), ``"auto"`` (time those that apply), or ``"tma"`` (the persistent TMA kernels,
    every shape class)."""
    global _forced_variant
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")
    old, _forced_variant = _forced_variant, name
    try:
        yield
    finally:
        _forced_variant = old


def _bucket(n: int) -> int:
    return max(16, int(triton.next_power_of_2(max(n, 1))))


# Candidates per kernel and shape class, as (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M tiles the
# queries and BLOCK_N the keys in every kernel. "short_kv": cross-attention with <= SHORT_KV keys (one key
# tile per sequence, many query rows per program); "few_q": PMA with <= FEW_Q queries (one query tile per
# sequence, long key tiles); "general": everything else. The dK/dV kernel's outer tile is BLOCK_N.
# Two per class and kernel, the H200's pick first (BENCHMARKS.md runs B and C), since a first call pays
# one compilation (~2 s) per candidate; key tiles longer than the keys' bucket are pruned.
_CANDIDATES = {
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
# 2-core CPU machine; not yet timed on the GPU), and only the first that fits is compiled: nothing to time.
_CANDIDATES_FP32 = {
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


def shape_class(bucket_q: int, bucket_kv: int) -> str:
    if bucket_kv <= SHORT_KV:
        return "short_kv"
    if bucket_q <= FEW_Q:
        return "few_q"
    return "general"


def _configs(kernel: str) -> list[triton.Config]:
    tables = (_CANDIDATES[kernel], _CANDIDATES_FP32[kernel])
    seen = {c for table in tables for cands in table.values() for c in cands}
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in sorted(seen)
    ]


def smem_bytes(kernel: str, bm: int, bn: int, stages: int, block_d: int, block_dv: int, elsize: int) -> int:
    """Upper estimate of a tiled kernel's shared memory: its resident tile(s) once, the streamed tiles once
    per pipeline stage (fwd: Q resident, K and V streamed; dQ: Q and dO resident; dK/dV: K and V resident,
    Q and dO streamed)."""
    row = (block_d + block_dv) * elsize
    resident, streamed = {"fwd": (bm * block_d * elsize, bn * row), "dq": (bm * row, bn * row),
                          "dkdv": (bn * row, bm * row)}[kernel]
    return resident + stages * streamed


def _smem_limit(t: torch.Tensor) -> int | None:
    if t.device.type != "cuda":
        return None  # the interpreter has no shared memory to run out of
    props = torch.cuda.get_device_properties(t.device)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) or None


def candidates_for(
    kernel: str, bucket_q: int, bucket_kv: int, dtype: torch.dtype, block_d: int, block_dv: int,
    smem_limit: int | None,
) -> list[tuple[int, int, int, int]]:
    """The (BLOCK_M, BLOCK_N, warps, stages) worth compiling for a bucket: those of its shape class and
    dtype class, with key tiles no longer than the keys' bucket and tiles that fit shared memory (pruned
    here rather than compiled and found too big). Never empty; at most :func:`tune_candidates` (one for
    fp32)."""
    fp32 = dtype == torch.float32
    cands = (_CANDIDATES_FP32 if fp32 else _CANDIDATES)[kernel][shape_class(bucket_q, bucket_kv)]
    elsize = 4 if fp32 else 2
    fits = [c for c in cands if smem_limit is None
            or smem_bytes(kernel, c[0], c[1], c[3], block_d, block_dv, elsize) <= smem_limit]
    kept = [c for c in fits if c[1] <= max(bucket_kv, 16)]
    kept = kept or fits[-1:] or [min(cands, key=lambda c: c[0] * c[1])]
    return kept[:1] if fp32 else kept[: tune_candidates()]


def _pruner(kernel: str) -> Callable[..., list[Any]]:
    def prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        """Keep :func:`candidates_for` the launch's bucket."""
        q = named_args["Q"]
        wanted = candidates_for(kernel, named_args["bucket_q"], named_args["bucket_kv"], q.dtype,
                                kwargs["BLOCK_D"], kwargs["BLOCK_DV"], _smem_limit(q))
        by_tuple = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
        return [by_tuple[w] for w in wanted]

    return prune


_KEY = ["bucket_b", "bucket_q", "bucket_kv", "band_kind", "ACT", "D", "DV", "PRECISION", "FAST_ACT"]


def _tuned(kernel: str, fn: Any) -> Any:
    # triton.autotune with its choices kept on disk (gem_kernels.tune_cache).
    return tune_cache.autotune(kernel, fn, _configs(kernel), _KEY, prune=_pruner(kernel))


_fwd_tuned = _tuned("fwd", fwd_kernel)
_dq_tuned = _tuned("dq", dq_kernel)
_dkdv_tuned = _tuned("dkdv", dkdv_kernel)
_fast_act_ok = True  # cleared if the hardware-tanh activations fail to compile on this GPU/Triton


def _onetile_tuned(name: str, fn: Any, stream_block: str, candidates: list[tuple[int, int, int]]) -> Any:
    """Autotuned over the streamed block only; the resident block is fixed by the caller (the bucket)."""
    configs = [triton.Config({stream_block: blk}, num_warps=w, num_stages=st) for blk, w, st in candidates]
    first = lambda cs, named_args, **kw: cs[: tune_candidates()]
    return tune_cache.autotune(name, fn, configs, _KEY, prune=first)


# Candidates of the one-tile kernels (one compilation per candidate timed on a first call).
_fwd_short_kv_tuned = _onetile_tuned("fwd_short_kv", fwd_short_kv_kernel, "BLOCK_M",
                                     [(128, 8, 3), (128, 4, 3)])
# One-tile backward candidates (streamed tile, warps, stages). First: the H200's pick (64, 4 warps, 3
# stages), which spills at 255 registers on sm_90 (ptxas, bf16 D=128 silu: short_kv 584 B, few_q 320 B).
# 8 warps on the same tile spill far less (48 B; few_q none, 214 registers) and double the warps per SM
# (the 4-warp kernels' 139-164 KB of shared memory already allow one program per SM): the second candidate,
# not yet timed (GEM_KERNELS_TUNE_CANDIDATES=2 or 3 on sm_90 times them). short_kv's former (128, 8, 3)
# needs 262-296 KB of shared memory: it cannot launch on sm_90, so it is gone; few_q's fits (196 KB, spills
# 468 B) and stays third. `compile_sm90.py onetile --regs` prints these figures.
SHORT_KV_BWD_CANDIDATES = [(64, 4, 3), (64, 8, 3)]
FEW_Q_BWD_CANDIDATES = [(64, 4, 3), (64, 8, 3), (128, 8, 3)]
_bwd_short_kv_tuned = _onetile_tuned("bwd_short_kv", bwd_short_kv_kernel, "BLOCK_M", SHORT_KV_BWD_CANDIDATES)
_bwd_few_q_tuned = _onetile_tuned("bwd_few_q", bwd_few_q_kernel, "BLOCK_N", FEW_Q_BWD_CANDIDATES)
# The split kernels: the same candidates as their whole-stream versions (not yet timed on the H200).
_bwd_short_kv_split_tuned = _onetile_tuned("bwd_short_kv_split", bwd_short_kv_split_kernel, "BLOCK_M",
                                           SHORT_KV_BWD_CANDIDATES)
_bwd_few_q_split_tuned = _onetile_tuned("bwd_few_q_split", bwd_few_q_split_kernel, "BLOCK_N",
                                        FEW_Q_BWD_CANDIDATES)
# (family, buckets, constexprs, dtype) -> "tiled", "onetile" or "onetile_split", decided by timing on the
# first call.
variant_choice: dict[tuple[Any, ...], str] = {}


def _launch_onetile(
    tuned: Any, raw: Any, grid: Grid, args: tuple[Any, ...], consts: Consts, resident: dict[str, int]
) -> None:
    """Launch a one-tile kernel: ``resident`` fixes the block of the short side."""
    if _fixed_blocks():
        bm, bn = _forced if _forced is not None else (32, 32)
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn, **resident}
        raw[grid](*args, **blocks, **consts)
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


def _choose(
    variant: str, key: tuple[Any, ...], kernels: list[Any], device: torch.device, tiled: Callable[[], None],
    onetile: Callable[[], None], split: Callable[[], None] | None = None,
) -> None:
    """Run ``tiled``, ``onetile`` or ``split`` (callables that launch; ``split`` only where a split kernel
    exists, else ``onetile_split`` runs ``onetile``), per ``variant`` (:func:`_resolved_variant`'s);
    "auto" on CUDA times each once per key and keeps the fastest, on disk too (:mod:`gem_kernels.tune_cache`:
    a new process reads the choice and compiles only the winner). Under the interpreter it runs ``onetile``.

    The candidates' names and kernels are part of the disk key, so a choice stored when there were two
    candidates (before ``onetile_split``) is not read for three: the bucket is timed once more."""
    launches = {"tiled": tiled, "onetile": onetile, "onetile_split": split or onetile}
    if variant != "auto" or (triton_interpreted() and not _tune_interpreted):
        launches.get(variant, onetile)()
        return
    if key not in variant_choice:
        def timer(launch: Callable[[], None]) -> Callable[[], float]:
            def run() -> float:
                launch()  # compile and autotune first
                return float(tune_cache.default_bench(launch, (0.5,))[0])
            return run

        def guarded(name: str, launch: Callable[[], None]) -> Callable[[], float]:
            def run() -> float:
                try:
                    return timer(launch)()
                except Exception as e:  # a kernel this GPU/Triton cannot build: keep the others
                    warnings.warn(f"{name} attention kernel unavailable ({type(e).__name__}: {e}); timing "
                                  "the others", stacklevel=5)
                    return float("inf")
            return run

        timers = {"tiled": timer(tiled), "onetile": guarded("one-tile", onetile)}
        if split is not None:
            timers["onetile_split"] = guarded("split one-tile", split)
        variant_choice[key], _ = tune_cache.choose(key, kernels, timers, device)
    launches[variant_choice[key]]()


def _launch(
    tuned: Any, raw: Any, grid_of: Callable[[int, int], Grid], args: tuple[Any, ...], consts: Consts
) -> None:
    """Launch ``raw`` with fixed blocks (interpreter or forced) or ``tuned`` (CUDA autotune).

    ``grid_of(block_m, block_n)`` gives the grid; axis 1 counts the tiles of the longest sequence."""
    if _fixed_blocks():
        bm, bn = _forced if _forced is not None else (32, 32)
        if 0 in grid_of(bm, bn):
            return
        raw[grid_of(bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, **consts)
    elif 0 not in grid_of(16, 16):
        _with_fast_act_fallback(
            lambda c: tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **c), consts
        )


def _setup(
    q: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, max_q_len: int, max_kv_len: int,
    activation: str, left: int, right: int,
) -> tuple[int, int, tuple[int, int, int, int], Consts]:
    """``(left, right, autotune buckets, constexprs)`` shared by the three launchers."""
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right
    band_kind = 0 if (left, right) == (UNBOUNDED, UNBOUNDED) else 1 if left == UNBOUNDED else 2
    d, dv = q.shape[2], v.shape[2]
    buckets = (_bucket(q_offsets.numel() - 1), _bucket(max_q_len), _bucket(max_kv_len), band_kind)
    consts: Consts = dict(
        ACT=ACTIVATION_IDS[activation],
        D=d,
        DV=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        # fp32 inputs get exact fp32 products unless the user allowed TF32, as torch.matmul does.
        PRECISION="tf32" if q.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee",
        # silu/gelu through the hardware tanh (2^-11 relative error, below bf16/fp16 rounding): CUDA only.
        FAST_ACT=(
            _fast_act_ok
            and not triton_interpreted()
            and q.dtype in (torch.bfloat16, torch.float16)
            and activation in ("silu", "gelu")
        ),
    )
    return left, right, buckets, consts


def _strides(*ts: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for t in ts for s in (t.stride(0), t.stride(1)))


def _choice_key(family: str, q: torch.Tensor, buckets: tuple[int, ...], consts: Consts) -> tuple[Any, ...]:
    return (family, q.dtype, *buckets, *sorted(consts.items()))


def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
    max_q_len: int, max_kv_len: int, activation: str, left: int, right: int, qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(out [total_q, H, Dv], lse [total_q, H] fp32, or empty for GDPA)``.

    Arguments as in :func:`gem_kernels.torch_ops.attention_reference.attention_fwd`, plus the host ints
    ``max_q_len``/``max_kv_len`` that size the grid."""
    batch, heads = q_offsets.numel() - 1, q.shape[1]
    out = torch.empty(q.shape[0], heads, v.shape[2], dtype=q.dtype, device=q.device)
    softmax = activation == "softmax"
    lse = torch.empty((q.shape[0], heads) if softmax else (0,), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or batch == 0 or heads == 0:
        return out, lse
    left, right, buckets, consts = _setup(q, v, q_offsets, max_q_len, max_kv_len, activation, left, right)
    if (variant := _resolved_variant("fwd", q, buckets, q, k, v)) in PERSISTENT_VARIANTS:
        from gem_kernels.triton_kernels import attention_persistent_launch as tp

        tp.attention_fwd(q, k, v, out, lse, q_offsets, kv_offsets, max_q_len, left, right, qk_scale,
                         out_scale, buckets, consts, variant, _forced)
        return out, lse
    args = (q, k, v, out, lse, q_offsets, kv_offsets, *_strides(q, k, v, out), heads, left, right, qk_scale,
            out_scale, *buckets)

    def tiled() -> None:
        grid_of = lambda bm, bn: (batch * heads, triton.cdiv(max_q_len, bm))
        _launch(_fwd_tuned, fwd_kernel, grid_of, args, consts)

    if shape_class(buckets[1], buckets[2]) != "short_kv":
        tiled()
        return out, lse

    def onetile() -> None:
        _launch_onetile(_fwd_short_kv_tuned, fwd_short_kv_kernel, (batch * heads,), args, consts,
                        {"BLOCK_N": buckets[2]})

    _choose(variant, _choice_key("fwd", q, buckets, consts), [fwd_kernel, fwd_short_kv_kernel], q.device,
            tiled, onetile)
    return out, lse


def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int,
    activation: str, left: int, right: int, qk_scale: float, out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: ``(dq, dk, dv)`` in the dtypes of ``(q, k, v)``.

    General: the dQ kernel (which also writes ``delta = rowsum(dO * O)`` for softmax), then the dK/dV
    kernel. Short keys or few queries: also a single fused one-tile kernel (see the module docstring)."""
    batch, heads = q_offsets.numel() - 1, q.shape[1]
    # Contiguous gradients whatever the inputs' strides (the kernels address them with row stride H*D).
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0 or heads == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout, out = dout.contiguous(), out.contiguous()  # dO is addressed with O's strides
    left, right, buckets, consts = _setup(q, v, q_offsets, max_q_len, max_kv_len, activation, left, right)
    if (variant := _resolved_variant("bwd", q, buckets, q, k, v, dout)) in PERSISTENT_VARIANTS:
        from gem_kernels.triton_kernels import attention_persistent_launch as tp

        tp.attention_bwd(dout, q, k, v, out, lse, dq, dk, dv, q_offsets, kv_offsets, max_q_len, max_kv_len,
                         left, right, qk_scale, out_scale, buckets, consts, variant, _forced)
        return dq, dk, dv
    strides = _strides(q, k, v, out)

    def tiled() -> None:
        delta = torch.empty_like(lse)
        if q.shape[0] > 0:
            args = (q, k, v, out, dout, dq, lse, delta, q_offsets, kv_offsets, *strides, heads, left, right,
                    qk_scale, out_scale, *buckets)
            _launch(_dq_tuned, dq_kernel, lambda bm, bn: (batch * heads, triton.cdiv(max_q_len, bm)), args,
                    consts)
        if k.shape[0] > 0:
            args = (q, k, v, dout, dk, dv, lse, delta, q_offsets, kv_offsets, *strides, heads, left, right,
                    qk_scale, out_scale, *buckets)
            _launch(_dkdv_tuned, dkdv_kernel, lambda bm, bn: (batch * heads, triton.cdiv(max_kv_len, bn)),
                    args, consts)

    kind = shape_class(buckets[1], buckets[2])
    if kind == "general":
        tiled()
        return dq, dk, dv
    args = (q, k, v, out, dout, dq, dk, dv, lse, q_offsets, kv_offsets, *strides, heads, left, right,
            qk_scale, out_scale, *buckets)
    if kind == "short_kv":
        def onetile() -> None:
            _launch_onetile(_bwd_short_kv_tuned, bwd_short_kv_kernel, (batch * heads,), args, consts,
                            {"BLOCK_N": buckets[2]})
    else:
        def onetile() -> None:
            _launch_onetile(_bwd_few_q_tuned, bwd_few_q_kernel, (batch * heads,), args, consts,
                            {"BLOCK_M": buckets[1]})

    def split() -> None:
        # (long side's offsets, rows, longest; short side's offsets and the gradients summed over chunks)
        if kind == "short_kv":
            _launch_split(kind, args, q_offsets, q.shape[0], max_q_len, kv_offsets, (dk, dv), buckets, consts)
        else:
            _launch_split(kind, args, kv_offsets, k.shape[0], max_kv_len, q_offsets, (dq,), buckets, consts)

    fused = bwd_short_kv_kernel if kind == "short_kv" else bwd_few_q_kernel
    fused_split = bwd_short_kv_split_kernel if kind == "short_kv" else bwd_few_q_split_kernel
    _choose(variant, _choice_key("bwd", q, buckets, consts),
            [dq_kernel, dkdv_kernel, fused, fused_split, sum_chunk_partials_kernel], q.device, tiled, onetile,
            split)
    return dq, dk, dv


def split_schedule(
    long_offsets: torch.Tensor, total_long: int, max_long: int, chunk: int, heads: int
) -> tuple[torch.Tensor, Grid]:
    """``(chunk_starts, grid)`` of a split one-tile backward (no host sync).

    Sequence ``b`` owns ``max(1, ceil(len_b / chunk))`` chunks of its long side (one even when empty: it
    writes the zero gradient of its short side); ``chunk_starts`` ``[B+1]`` int32 on the device is their
    exclusive prefix sum. The grid ``(P, H)`` bounds the chunk count from the host ints: ``max(1, ceil(n /
    c)) <= 1 + n // c`` per sequence gives ``P <= B + total // c``, and at most ``B * max(1, ceil(max_len /
    c))``; the spare programs (P minus the true count, under one per sequence) exit at once."""
    batch = long_offsets.numel() - 1
    lengths = long_offsets[1:] - long_offsets[:-1]
    counts = torch.clamp_min(torch.div(lengths + (chunk - 1), chunk, rounding_mode="floor"), 1)
    chunk_starts = torch.zeros(batch + 1, dtype=torch.int32, device=long_offsets.device)
    chunk_starts[1:] = torch.cumsum(counts, 0)
    programs = min(batch + total_long // chunk, batch * max(1, triton.cdiv(max_long, chunk)))
    return chunk_starts, (programs, heads)


def _launch_split(
    kind: str, args: tuple[Any, ...], long_offsets: torch.Tensor, total_long: int, max_long: int,
    short_offsets: torch.Tensor, short_grads: tuple[torch.Tensor, ...], buckets: tuple[int, int, int, int],
    consts: Consts,
) -> None:
    """The split one-tile backward of ``kind`` (see :mod:`.attention_onetile`): the chunk schedule, the
    fp32 workspace of the short side's partial gradients ``short_grads`` (dK, dV or dQ), the split kernel,
    then the sum of the partials. ``args`` are the whole-stream kernel's; the workspace is allocated and the
    sum launched only when some sequence is longer than a chunk (``max_long``)."""
    chunk = _forced_chunk or SPLIT_CHUNK[kind]
    batch, heads = short_offsets.numel() - 1, short_grads[0].shape[1]
    chunk_starts, grid = split_schedule(long_offsets, total_long, max_long, chunk, heads)
    block = buckets[2] if kind == "short_kv" else buckets[1]  # the resident (short) side's tile
    split_needed = max_long > chunk
    if split_needed:
        parts = tuple(torch.empty(grid[0], heads, block, g.shape[2], dtype=torch.float32, device=g.device)
                      for g in short_grads)
    else:  # every sequence is one chunk: no workspace is touched (a 1-element placeholder pointer)
        parts = tuple(torch.empty(1, dtype=torch.float32, device=g.device) for g in short_grads)
    # The whole-stream kernels' arguments, with the schedule and workspace after the offsets, and the
    # sequence count and chunk rows after the scales.
    split_args = (*args[:11], chunk_starts, *parts, *args[11:-4], batch, chunk, *args[-4:])
    resident = {"BLOCK_N" if kind == "short_kv" else "BLOCK_M": block,
                "LOG_B": buckets[0].bit_length() - 1}
    if kind == "short_kv":
        _launch_onetile(_bwd_short_kv_split_tuned, bwd_short_kv_split_kernel, grid, split_args, consts,
                        resident)
    else:
        _launch_onetile(_bwd_few_q_split_tuned, bwd_few_q_split_kernel, grid, split_args, consts, resident)
    if not split_needed:
        return
    for part, g in zip(parts, short_grads, strict=True):
        d = g.shape[2]
        sum_chunk_partials_kernel[(batch, heads)](
            part, g, chunk_starts, short_offsets, heads, D=d, BLOCK_R=block,
            BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4)
