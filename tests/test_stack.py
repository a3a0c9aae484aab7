"""The pinned stack imports and works together (the ABI coupling users most often trip on)."""

from __future__ import annotations

import importlib.metadata as md

import torch


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# fbgemm must match torch exactly (undefined symbols otherwise): fbgemm minor -> torch minor.
FBGEMM_FOR_TORCH = {(1, 6): (2, 11), (1, 7): (2, 12), (1, 8): (2, 13), (1, 9): (2, 14)}


def test_fbgemm_matches_torch():
    fbgemm = next(d for d in ("fbgemm-gpu-cpu", "fbgemm-gpu") if _has_dist(d))
    assert FBGEMM_FOR_TORCH[_minor(md.version(fbgemm))] == _minor(torch.__version__)


def _has_dist(name: str) -> bool:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def test_torchrec_and_fbgemm_ops_load():
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    from torchrec import KeyedJaggedTensor

    values = torch.arange(5, dtype=torch.float32).unsqueeze(1)
    offsets = torch.tensor([0, 2, 2, 5])
    dense = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [3], 0.0)
    assert dense.shape == (3, 3, 1)
    assert dense[1].abs().sum() == 0 and dense[2, :, 0].tolist() == [2.0, 3.0, 4.0]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])
    )
    assert kjt["a"].to_dense()[0].tolist() == [1, 2]


def test_triton_imports():
    import triton
    import triton.language as tl  # noqa: F401

    assert _minor(triton.__version__) >= (3, 6)
