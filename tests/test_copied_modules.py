"""The modules gem's packages carry as copies, and the check that each set of copies stays one module.

Every package installs and imports alone, with only the distributions it declares (tools/check_layers.py),
so two small modules are copied rather than shared (a sixth distribution for ~80 and ~120 lines would be
one more thing to version, release and pin):

- ``dispatch.py`` (backend choice: ``auto`` / ``triton`` / ``reference``) in gem-kernels and gem-precision,
  which may not import each other: identical but for the package's import name and its environment
  variable's prefix (``GEM_KERNELS_BACKEND``, ``GEM_PRECISION_BACKEND``).
- ``_stack.py`` (the torchrec/fbgemm import check) in gem-model and gem-parallel (gem-parallel may not
  import gem-model): byte for byte (tools/check_release.py checks that too).

Each package's README names its copy in its architecture section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Copies:
    """One module carried by several packages: ``name`` in ``src/<package>/`` of each of ``packages``
    (import names); with ``rename``, each copy may differ by its own package name (and its upper-case
    form), nothing else."""

    name: str
    packages: tuple[str, ...]
    rename: bool

    def path(self, package: str) -> Path:
        return ROOT / "packages" / package.replace("_", "-") / "src" / package / self.name

    def normalized(self, package: str, text: str) -> str:
        if not self.rename:
            return text
        return text.replace(package, "<package>").replace(package.upper(), "<PACKAGE>")


COPIES = (
    Copies("dispatch.py", ("gem_kernels", "gem_precision"), rename=True),
    Copies("_stack.py", ("gem_model", "gem_parallel"), rename=False),
)


def drift(copies: Copies, texts: dict[str, str]) -> list[str]:
    """The packages whose copy (normalized) differs from the first package's."""
    first = copies.packages[0]
    want = copies.normalized(first, texts[first])
    return [p for p in copies.packages[1:] if copies.normalized(p, texts[p]) != want]


@pytest.mark.parametrize("copies", COPIES, ids=lambda c: c.name)
def test_copies_are_one_module(copies: Copies):
    texts = {p: copies.path(p).read_text() for p in copies.packages}
    assert drift(copies, texts) == [], f"{copies.name} differs between {copies.packages}: change every copy"


@pytest.mark.parametrize("copies", COPIES, ids=lambda c: c.name)
def test_each_copy_says_it_is_one(copies: Copies):
    for p in copies.packages:
        assert "tests/test_copied_modules.py" in copies.path(p).read_text(), p


def test_drift_is_caught_and_renames_are_not():
    dispatch, stack = COPIES
    texts = {p: dispatch.path(p).read_text() for p in dispatch.packages}
    assert drift(dispatch, texts) == []
    edited = dict(texts, gem_precision=texts["gem_precision"].replace('"auto"', '"automatic"', 1))
    assert drift(dispatch, edited) == ["gem_precision"]
    # A package name left behind in the other copy is drift too.
    leaked = dict(texts, gem_precision=texts["gem_precision"].replace("gem_precision", "gem_kernels", 1))
    assert drift(dispatch, leaked) == ["gem_precision"]
    stack_texts = {p: stack.path(p).read_text() for p in stack.packages}
    renamed = dict(stack_texts, gem_parallel=stack_texts["gem_parallel"].replace("gem-model", "gem_model"))
    assert drift(stack, renamed) == ["gem_parallel"]
