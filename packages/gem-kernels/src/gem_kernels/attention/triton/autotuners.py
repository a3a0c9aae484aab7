"""Every autotuned attention kernel: ``triton.autotune`` over the candidates of :mod:`..variants`, with the
choices kept on disk by :func:`gem_kernels.tune_cache.autotune` (the package's one tuning cache).

The key is bucketed (batch and longest lengths to powers of two, band kind, activation, head dims,
precision, the fast-tanh flag; the persistent kernels add the TMA flag), so ragged
batches do not retune every step. :data:`AUTOTUNERS` holds them by the name they carry in the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from gem_kernels import tune_cache
from gem_kernels.attention import variants
from gem_kernels.attention.triton.bwd import dkdv_kernel, dq_kernel
from gem_kernels.attention.triton.fwd import fwd_kernel
from gem_kernels.attention.triton.onetile import (
    bwd_few_q_kernel,
    bwd_few_q_split_kernel,
    bwd_short_kv_kernel,
    bwd_short_kv_split_kernel,
    fwd_short_kv_kernel,
)
from gem_kernels.attention.triton.persistent import (
    dkdv_persistent_kernel,
    dq_persistent_kernel,
    fwd_persistent_kernel,
)

KEY = ["bucket_b", "bucket_q", "bucket_kv", "band_kind", "ACT", "D", "DV", "PRECISION", "FAST_ACT"]
PERSISTENT_KEY = [*KEY, "USE_TMA"]


def smem_limit(t: torch.Tensor) -> int | None:
    """Shared memory per block of ``t``'s device (opt-in maximum), or None off CUDA (the interpreter has
    none to run out of)."""
    if t.device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(t.device)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) or None


def tiled_configs(kernel: str) -> list[Any]:
    """Every candidate of tiled ``kernel`` (all shape and dtype classes) as a ``triton.Config``."""
    tables = (variants.CANDIDATES[kernel], variants.CANDIDATES_FP32[kernel])
    seen = {c for table in tables for cands in table.values() for c in cands}
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in sorted(seen)
    ]


def _tiled_pruner(kernel: str) -> Callable[..., list[Any]]:
    def prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        """Keep :func:`..variants.candidates_for` the launch's bucket."""
        q = named_args["Q"]
        wanted = variants.candidates_for(
            kernel,
            named_args["bucket_q"],
            named_args["bucket_kv"],
            q.dtype,
            kwargs["BLOCK_D"],
            kwargs["BLOCK_DV"],
            smem_limit(q),
        )
        by_tuple = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
        return [by_tuple[w] for w in wanted]

    return prune


def _first_candidates(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    return configs[: tune_cache.tune_candidates()]


def _tiled(kernel: str, fn: Any) -> Any:
    return tune_cache.autotune(kernel, fn, tiled_configs(kernel), KEY, prune=_tiled_pruner(kernel))


def _onetile(name: str, fn: Any, stream_block: str, candidates: list[tuple[int, int, int]]) -> Any:
    """Autotuned over the streamed block only; the resident block is fixed by the caller (the bucket)."""
    configs = [triton.Config({stream_block: blk}, num_warps=w, num_stages=st) for blk, w, st in candidates]
    return tune_cache.autotune(name, fn, configs, KEY, prune=_first_candidates)


def _persistent(kernel: str, fn: Any) -> Any:
    inner = "BLOCK_M" if kernel == "dkdv" else "BLOCK_N"
    outer = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
    configs = [
        triton.Config({outer: variants.PERSISTENT_OUTER_TILE, inner: blk}, num_warps=w, num_stages=st)
        for blk, w, st in variants.PERSISTENT_CANDIDATES[kernel]
    ]
    # The work counter is consumed by each run: zero it before every timed run and the final one.
    return tune_cache.autotune(
        f"persistent_{kernel}",
        fn,
        configs,
        PERSISTENT_KEY,
        prune=_first_candidates,
        reset_to_zero=["counter"],
    )


AUTOTUNERS: dict[str, Any] = {
    "fwd": _tiled("fwd", fwd_kernel),
    "dq": _tiled("dq", dq_kernel),
    "dkdv": _tiled("dkdv", dkdv_kernel),
    "fwd_short_kv": _onetile(
        "fwd_short_kv", fwd_short_kv_kernel, "BLOCK_M", variants.FWD_SHORT_KV_CANDIDATES
    ),
    "bwd_short_kv": _onetile(
        "bwd_short_kv", bwd_short_kv_kernel, "BLOCK_M", variants.SHORT_KV_BWD_CANDIDATES
    ),
    "bwd_few_q": _onetile("bwd_few_q", bwd_few_q_kernel, "BLOCK_N", variants.FEW_Q_BWD_CANDIDATES),
    "bwd_short_kv_split": _onetile(
        "bwd_short_kv_split", bwd_short_kv_split_kernel, "BLOCK_M", variants.SHORT_KV_BWD_CANDIDATES
    ),
    "bwd_few_q_split": _onetile(
        "bwd_few_q_split", bwd_few_q_split_kernel, "BLOCK_N", variants.FEW_Q_BWD_CANDIDATES
    ),
    "persistent_fwd": _persistent("fwd", fwd_persistent_kernel),
    "persistent_dq": _persistent("dq", dq_persistent_kernel),
    "persistent_dkdv": _persistent("dkdv", dkdv_persistent_kernel),
}
