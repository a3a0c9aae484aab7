"""gem_train.transfer.heap: glibc's thresholds set where glibc is, False elsewhere, bad input refused."""

from __future__ import annotations

import ctypes
import platform

import pytest

from gem_train.transfer import heap


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_sets_the_thresholds_on_glibc() -> None:
    assert heap.keep_freed_memory() is True
    assert heap.keep_freed_memory() is True  # idempotent


def test_no_mallopt_is_false(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: object) -> object:
        raise OSError("no C library here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert heap.keep_freed_memory() is False


@pytest.mark.parametrize("bad", [(0, 1), (1, -1)])
def test_bad_thresholds(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="positive"):
        heap.keep_freed_memory(*bad)
