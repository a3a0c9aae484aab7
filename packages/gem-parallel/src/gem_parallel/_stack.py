"""Import torchrec and fbgemm once, turning a mismatched stack into an error that says how to fix it.

fbgemm's native libraries are built against one torch release (fbgemm 1.x pairs with torch 2.(x+5)); with
any other torch, or the CUDA build on a machine without a GPU driver, loading them fails deep inside
torchrec's import with an undefined symbol or a missing library. :func:`import_sparse_stack` catches that
and raises an ``ImportError`` naming the installed versions and the extra that installs a matched set. The
success path is the plain import, so it adds nothing to import time; the diagnosis runs only on failure.

Importing this module runs the check for the package it belongs to. A documented copy: gem-model and
gem-parallel each carry this file, byte for byte (each installs alone, and gem-parallel may not import
gem-model: tools/check_layers.py); tools/check_release.py and tests/test_copied_modules.py at the
workspace root fail when the copies drift.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
from pathlib import Path

__all__ = ["import_sparse_stack", "sparse_stack_error"]

_FBGEMM_DISTS = ("fbgemm-gpu-cpu", "fbgemm-gpu")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def torch_minor_for_fbgemm(fbgemm_version: str) -> tuple[int, int] | None:
    """The torch minor an fbgemm release is built for (FBGEMM's release table), or None if unknown."""
    minor = _minor(fbgemm_version)
    return (2, minor[1] + 5) if minor and minor[0] == 1 else None


def _installed_variant() -> str | None:
    """``cpu`` or ``cuda``: which build's files are in the ``fbgemm_gpu`` folder (both distributions
    install into the same folder, so the last one installed wins), read without importing it."""
    spec = importlib.util.find_spec("fbgemm_gpu")
    if spec is None or spec.origin is None:
        return None
    target = Path(spec.origin).parent / "docs" / "target.default.json.py"
    try:
        variant = json.loads(target.read_text()).get("variant")
    except (OSError, ValueError):
        return None
    return variant if isinstance(variant, str) else None


def _extra_pins(package: str, extra: str) -> list[str]:
    """The requirements the package's ``extra`` adds, read from its installed metadata."""
    try:
        requires = md.requires(package) or []
    except md.PackageNotFoundError:
        return []
    marker = re.compile(rf"""extra\s*==\s*['"]{extra}['"]""")
    return [r.split(";")[0].strip() for r in requires if marker.search(r)]


def _diagnosis(package: str, torch_v: str | None, fbgemm: dict[str, str], variant: str | None) -> list[str]:
    """What is wrong with the installed set, and the command that fixes it (one line per finding)."""
    fix = f'pip install "{package}[cpu]" (CPU) or "{package}[cuda]" (CUDA)'
    if not fbgemm:
        return [f"fbgemm is not installed: {fix}."]
    out = []
    torch_minor = _minor(torch_v) if torch_v else None
    wrong = [
        f"{dist} {v} is built for torch {want[0]}.{want[1]}"
        for dist, v in fbgemm.items()
        if (want := torch_minor_for_fbgemm(v)) and torch_minor and want != torch_minor
    ]
    if wrong:
        pins = ", ".join(_extra_pins(package, "cpu")) or "a tested set"
        out.append(f"{'; '.join(wrong)}, but torch is {torch_v}: fbgemm must match torch exactly.")
        out.append(f"Install a matched set: {fix}; they pin {pins}.")
    if variant == "cuda" and "fbgemm-gpu-cpu" in fbgemm:
        out.append(
            "The CUDA build of fbgemm-gpu (torchrec requires it by name) was installed over the files of "
            "fbgemm-gpu-cpu, and it cannot load without a GPU driver. On a CPU machine put the CPU build "
            f'back: pip install --force-reinstall --no-deps "fbgemm-gpu-cpu=={fbgemm["fbgemm-gpu-cpu"]}"'
        )
    elif variant == "cuda" and not wrong:
        out.append(
            "The CUDA build of fbgemm loads only with a GPU driver and the CUDA build of torch; on a CPU "
            f'machine install "{package}[cpu]" (the README\'s Install section has the steps).'
        )
    return out or [f"Reinstall a matched set: {fix}."]


def sparse_stack_error(package: str, error: BaseException) -> str:
    """The message for a failed torchrec/fbgemm import: the versions found, what is wrong, the fix."""
    torch_v = _version("torch")
    fbgemm = {dist: v for dist in _FBGEMM_DISTS if (v := _version(dist)) is not None}
    found = [("torch", torch_v), ("torchrec", _version("torchrec")), *fbgemm.items()]
    return "\n".join(
        [
            f"{package} cannot import torchrec/fbgemm ({type(error).__name__}: {error}).",
            "Found: " + (", ".join(f"{d} {v}" for d, v in found if v) or "none of them") + ".",
            *_diagnosis(package, torch_v, fbgemm, _installed_variant()),
        ]
    )


def import_sparse_stack(package: str) -> None:
    """Import fbgemm_gpu and torchrec (registering ``torch.ops.fbgemm``) or raise a clear ImportError."""
    try:
        import fbgemm_gpu  # noqa: F401  (loads the native libraries: where a mismatch shows)
        import torchrec  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(sparse_stack_error(package, error)) from error


# Runs when the package imports this module, before any of its modules imports torchrec.
import_sparse_stack(__name__.split(".")[0].replace("_", "-"))
