"""Host-side batch prefetching: batches built ahead, pinned, and copied to the GPU one step ahead.

:class:`DevicePrefetcher` wraps any iterator of host items (e.g. the DataLoader's ``LoadedBatch``) and yields
``(host_item, device_batch)`` pairs. On CUDA, while step ``k`` computes on the current stream, batch
``k + 1`` is copied with ``non_blocking=True`` on a side stream from page-locked memory; the current stream
waits for that copy only when the batch is handed out (an event, no host sync), and the batch's memory is
recorded on the current stream so the caching allocator does not reuse it early. Optionally a background
thread builds (and pins) ``host_ahead`` items ahead, for sources that build batches in the main process
(``num_workers = 0``). On the CPU it is a passthrough (``batch.to(device)``, no thread unless asked).

Usage in a training loop::

    batches = DevicePrefetcher(loader, device, select=lambda lb: lb.batch)
    for lb, batch in batches:   # lb: the host item, batch: lb.batch on the device
        ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

__all__ = ["DevicePrefetcher"]

T = TypeVar("T")


_DONE = object()


class _HostAhead(Generic[T]):
    """Iterates ``items`` in a daemon thread, ``depth`` items ahead (``prepare`` applied there)."""

    def __init__(self, items: Iterator[T], depth: int, prepare: Callable[[T], Any]) -> None:
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items, prepare), daemon=True)
        self._thread.start()

    def _put(self, entry: tuple[bool, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items: Iterator[T], prepare: Callable[[T], Any]) -> None:
        try:
            for item in items:
                if not self._put((True, (item, prepare(item)))):
                    return
            self._put((False, _DONE))
        except BaseException as e:  # handed to the consumer, raised there
            self._put((False, e))

    def __next__(self) -> tuple[T, Any]:
        ok, value = self._queue.get()
        if ok:
            return value
        self.close()
        if value is _DONE:
            raise StopIteration
        raise value

    def close(self) -> None:
        self._stop.set()


class DevicePrefetcher(Generic[T]):
    """Yields ``(item, select(item) on device)`` for each item of ``items``, in order.

    Args:
        items: host items (an iterable; iterated once).
        device: where the batches go.
        select: the batch of an item (``.to(device, non_blocking)``, ``.pin_memory()`` and, on CUDA,
            ``.record_stream(stream)``, as :class:`gem_model.GemBatch` has); default the item itself.
        host_ahead: items built (and, on CUDA, pinned) ahead in a background thread; 0: no thread.
        pin: pin batches that are not pinned yet (CUDA only; a DataLoader with ``pin_memory=True`` already
            pins them).

    An exception raised by ``items`` is raised by the ``next`` call that would have returned that item.
    """

    def __init__(
        self,
        items: Iterable[T],
        device: torch.device,
        *,
        select: Callable[[T], Any] | None = None,
        host_ahead: int = 0,
        pin: bool = True,
    ) -> None:
        if host_ahead < 0:
            raise ValueError(f"DevicePrefetcher: host_ahead must be >= 0, got {host_ahead}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._select: Callable[[T], Any] = select if select is not None else (lambda item: item)
        self._pin = pin and self._cuda
        source = iter(items)
        self._ahead: _HostAhead[T] | None = (
            _HostAhead(source, host_ahead, self._prepare) if host_ahead > 0 else None
        )
        self._source = source
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._next: tuple[str, Any] | None = None  # ("ok", (item, batch, event)) | ("error", exc) | ("end",)
        self._started = False

    def _prepare(self, item: T) -> Any:
        batch = self._select(item)
        if self._pin and not _is_pinned(batch):
            batch = batch.pin_memory()
        return batch

    def _pull(self) -> tuple[T, Any]:
        if self._ahead is not None:
            return next(self._ahead)
        item = next(self._source)
        return item, self._prepare(item)

    def _issue(self) -> None:
        """Fetch the next item and start its copy (on the side stream on CUDA)."""
        try:
            item, host_batch = self._pull()
        except StopIteration:
            self._next = ("end", None)
            return
        except Exception as e:  # raised when this item is asked for
            self._next = ("error", e)
            return
        if self._stream is None:
            self._next = ("ok", (item, host_batch.to(self.device), None))
            return
        with torch.cuda.stream(self._stream):
            batch = host_batch.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._next = ("ok", (item, batch, event))

    def __iter__(self) -> Iterator[tuple[T, Any]]:
        return self

    def __next__(self) -> tuple[T, Any]:
        if not self._started:
            self._started = True
            self._issue()
        assert self._next is not None
        kind, value = self._next
        if kind == "end":
            raise StopIteration
        if kind == "error":
            self._next = ("end", None)
            raise value
        item, batch, event = value
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)  # the GPU waits for the copy; the host does not
            batch.record_stream(current)
        self._issue()  # the next copy overlaps this step's compute
        return item, batch

    def close(self) -> None:
        """Stops the host thread (if any); the prefetcher yields nothing more."""
        if self._ahead is not None:
            self._ahead.close()
        self._started = True
        self._next = ("end", None)


def _is_pinned(batch: Any) -> bool:
    is_pinned = getattr(batch, "is_pinned", None)
    return bool(is_pinned()) if callable(is_pinned) else False
