"""A small memo keyed by tensor *values*, for what the CPU paths derive from a batch's lengths.

One forward of the GEM model calls jagged attention seven times and rotary four times over the same few
offsets and positions; the index plans, sparsity patterns and cos/sin tables derived from them are the same
every time. Keys compare by value (``torch.equal``, after dtype, shape and device), never by identity, and are
stored as copies: a key tensor changed in place by its owner afterwards can not match the old entry.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

V = TypeVar("V")
KeyPart = torch.Tensor | Hashable | None


def _same(a: KeyPart, b: KeyPart) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    return a == b


class ValueMemo(Generic[V]):
    """Least-recently-used memo of at most ``size`` entries; keys are tuples of tensors and hashables.

    Meant for CPU tensors of a batch's metadata (offsets ``[B+1]``, positions ``[total]``): a lookup costs one
    ``torch.equal`` per tensor of each entry it passes. Values are shared between callers: read-only."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[tuple[KeyPart, ...], V]] = []

    def get(self, key: tuple[KeyPart, ...], make: Callable[[], V]) -> V:
        """The value stored under ``key``, or ``make()`` stored under a copy of ``key``."""
        for i, (stored, value) in enumerate(self._entries):
            if len(stored) == len(key) and all(_same(a, b) for a, b in zip(stored, key, strict=True)):
                self._entries.insert(0, self._entries.pop(i))
                return value
        value = make()
        frozen = tuple(k.detach().clone() if isinstance(k, torch.Tensor) else k for k in key)
        self._entries.insert(0, (frozen, value))
        del self._entries[self.size :]
        return value

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
