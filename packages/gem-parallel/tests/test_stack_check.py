"""gem-parallel's modules that use torchrec import ``gem_parallel._stack`` first: a mismatched torch /
fbgemm pair then fails with the versions and the fix (the diagnosis itself is tested in gem-model, whose
``_stack.py`` is the same file: tests/test_release.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_stack_imports_torchrec_and_registers_fbgemm_ops():
    import torch

    import gem_parallel._stack  # noqa: F401

    assert hasattr(torch.ops.fbgemm, "jagged_to_padded_dense")
    assert "torchrec" in sys.modules


def test_failing_fbgemm_load_names_gem_parallel_and_the_extras(tmp_path: Path):
    fake = tmp_path / "fbgemm_gpu"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('fbgemm_gpu_py.so: undefined symbol: _ZN3c10')\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        try:
            import gem_parallel._stack
        except ImportError as e:
            print(e)
            sys.exit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "gem-parallel cannot import torchrec/fbgemm (OSError:" in proc.stdout
    assert '"gem-parallel[cpu]"' in proc.stdout or "fbgemm-gpu-cpu" in proc.stdout
