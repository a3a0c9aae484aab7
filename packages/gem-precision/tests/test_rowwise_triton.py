"""The column-wise (transposed) and two-copy row-wise FP8 Triton kernels against the PyTorch reference.

On the CPU under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before triton is imported);
on a GPU natively at the model's shapes. The checks are in ``_triton_rowwise_checks.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_triton_rowwise_checks.py")


def _run(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=280
    )


def test_rowwise_kernels_under_interpreter():
    pytest.importorskip("triton")
    proc = _run({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAILED: none" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rowwise_kernels_on_gpu():
    proc = _run({}, "--big")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
