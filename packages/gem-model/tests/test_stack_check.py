"""A mismatched torch / fbgemm / torchrec stack fails at ``import gem_model`` with an error that names the
versions and the fix (gem_model/_stack.py), not with fbgemm's undefined symbol. That the import goes
through the check: tests/test_stack_wiring.py at the root (for gem-parallel too)."""

from __future__ import annotations

import pytest
import torch

from gem_model import _stack


def _message(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str], variant: str | None) -> str:
    monkeypatch.setattr(_stack, "_version", versions.get)
    monkeypatch.setattr(_stack, "_installed_variant", lambda: variant)
    return _stack.sparse_stack_error("gem-model", OSError("fbgemm_gpu_py.so: undefined symbol: _ZN3c10"))


def test_fbgemm_built_for_another_torch_names_both_versions_and_the_extras(monkeypatch):
    msg = _message(
        monkeypatch, {"torch": "2.13.0+cpu", "torchrec": "1.9.2", "fbgemm-gpu-cpu": "1.9.0"}, "cpu"
    )
    assert "undefined symbol" in msg  # the original error is kept
    assert "Found: torch 2.13.0+cpu, torchrec 1.9.2, fbgemm-gpu-cpu 1.9.0." in msg
    assert "fbgemm-gpu-cpu 1.9.0 is built for torch 2.14, but torch is 2.13.0+cpu" in msg
    assert 'pip install "gem-model[cpu]" (CPU) or "gem-model[cuda]" (CUDA)' in msg


def test_cuda_build_over_the_cpu_build_says_how_to_put_the_cpu_build_back(monkeypatch):
    versions = {"torch": "2.13.0+cpu", "torchrec": "1.8.0", "fbgemm-gpu": "1.8.0", "fbgemm-gpu-cpu": "1.8.0"}
    msg = _message(monkeypatch, versions, "cuda")
    assert "is built for torch" not in msg  # the versions pair; the build is what is wrong
    assert 'pip install --force-reinstall --no-deps "fbgemm-gpu-cpu==1.8.0"' in msg


def test_cuda_build_alone_points_to_the_cpu_extra(monkeypatch):
    msg = _message(monkeypatch, {"torch": "2.13.0", "torchrec": "1.8.0", "fbgemm-gpu": "1.8.0"}, "cuda")
    assert "GPU driver" in msg and '"gem-model[cpu]"' in msg


def test_missing_fbgemm(monkeypatch):
    msg = _message(monkeypatch, {"torch": "2.13.0"}, None)
    assert "Found: torch 2.13.0." in msg and "fbgemm is not installed" in msg


def test_torch_minor_for_fbgemm_follows_the_release_table():
    # FBGEMM's table: 1.6 <-> 2.11, 1.8 <-> 2.13, 1.9 <-> 2.14; 0.x releases are not mapped.
    assert [_stack.torch_minor_for_fbgemm(v) for v in ("1.6.0", "1.8.0", "1.9.0")] == [
        (2, 11),
        (2, 13),
        (2, 14),
    ]
    assert _stack.torch_minor_for_fbgemm("0.8.0") is None


def test_installed_stack_pairs():
    # This environment's own fbgemm is the one the check would accept.
    import fbgemm_gpu

    assert _stack.torch_minor_for_fbgemm(fbgemm_gpu.__version__) == tuple(
        int(p) for p in torch.__version__.split(".")[:2]
    )
