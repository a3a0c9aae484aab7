"""gem-model's import, and gem-parallel's ``_stack`` (which its TorchRec modules import first), go through
the torch/fbgemm pairing check: a failing fbgemm load becomes gem's diagnosis, not the bare OSError.

(The diagnosis itself is tested in packages/gem-model/tests/test_stack_check.py; both packages carry the
same ``_stack.py``, which tools/check_release.py keeps identical.)"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize(
    ("module", "package"), [("gem_model", "gem-model"), ("gem_parallel._stack", "gem-parallel")]
)
def test_a_failing_fbgemm_load_is_reported_with_versions_and_the_fix(
    tmp_path: Path, module: str, package: str
):
    # An fbgemm_gpu that fails as a mismatched one does (OSError from torch.ops.load_library), first on the
    # path of a fresh interpreter.
    fake = tmp_path / "fbgemm_gpu"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('fbgemm_gpu_py.so: undefined symbol: _ZN3c104cuda')\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        try:
            import {module}
        except ImportError as e:
            print(e)
            sys.exit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        f"{package} cannot import torchrec/fbgemm (OSError: fbgemm_gpu_py.so: undefined symbol" in proc.stdout
    )
    assert f"Found: torch {md.version('torch')}" in proc.stdout
    assert f'"{package}[cpu]"' in proc.stdout


def test_gem_parallel_stack_loads_fbgemm_ops():
    import gem_parallel._stack  # noqa: F401

    assert hasattr(torch.ops.fbgemm, "jagged_to_padded_dense") and "torchrec" in sys.modules
