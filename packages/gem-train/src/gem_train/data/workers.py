"""DataLoader workers that end cleanly: their errors reach the main process intact, and they never outlive it.

torch's DataLoader re-raises a worker's exception in the main process as a new exception built from the
formatted traceback text (``ExceptionWrapper.reraise``): a ``RuntimeError`` whenever the original type cannot
be rebuilt from one string (as :class:`~gem_train.data.parquet.errors.ParquetDataError`), and with the
worker's traceback as its message. The workers stay alive meanwhile, and the frames of that traceback keep
the loader's iterator alive too; a process that then ends with them running waits for them at interpreter exit
(``multiprocessing`` terminates and joins its daemonic children; a worker that ignores SIGTERM never joins).

Here instead:

- a worker that raises sends its exception to the main process as a data item (:class:`WorkerFailure`: the
  exception pickled, with its traceback as text), after which that worker's stream ends;
- :class:`LoaderIterator` shuts the workers down and raises the original exception (type, message and
  attributes; the worker's traceback as a note) at the batch it would have made: the same error as with
  ``num_workers = 0``, at the same point of the stream;
- an iterator shuts its workers down on ``close()``, at the end of a ``with`` block, when it is dropped, and
  at interpreter exit (an ``atexit`` hook that runs before ``multiprocessing``'s and torch's own);
- workers move to their own process group (:func:`worker_init`), so the signals a launcher or a terminal sends
  to the trainer's group (torchrun's SIGTERM, Ctrl-C) leave them to the main process, which stops at a step
  boundary and shuts them down, while a SIGTERM sent to a worker itself still ends it.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = [
    "Loader",
    "LoaderIterator",
    "LoaderWorkerError",
    "WorkerFailure",
    "close_all_loaders",
    "guarded",
    "worker_init",
]


class LoaderWorkerError(RuntimeError):
    """An exception raised in a loader worker whose type could not be sent to the main process (it does not
    pickle); the message names the original type."""


class WorkerFailure:
    """An exception raised in a loader worker, carried to the main process as an ordinary data item."""

    __slots__ = ("message", "pickled", "type_name", "worker_traceback")

    def __init__(self, exc: BaseException) -> None:
        self.type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.message = str(exc)
        self.worker_traceback = "".join(traceback.format_exception(exc))
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)  # an exception that pickles but cannot be rebuilt is sent by name
        except Exception:
            pickled = None
        self.pickled = pickled

    def exception(self) -> BaseException:
        """The original exception (or a :class:`LoaderWorkerError` naming its type and message)."""
        exc: BaseException
        if self.pickled is not None:
            exc = pickle.loads(self.pickled)  # bytes our own worker made just now, through the loader's queue
        else:
            exc = LoaderWorkerError(f"{self.type_name}: {self.message}")
        exc.add_note(f"raised in a DataLoader worker process:\n{self.worker_traceback.rstrip()}")
        return exc


class _Guarded(IterableDataset):
    """``stream`` whose exceptions in a worker process become a final :class:`WorkerFailure` item."""

    def __init__(self, stream: IterableDataset) -> None:
        super().__init__()
        self.stream = stream

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is None:  # the main process: exceptions propagate as they are
            yield from self.stream
            return
        try:
            yield from self.stream
        except Exception as e:
            yield WorkerFailure(e)


def guarded(stream: IterableDataset) -> IterableDataset:
    """Wrap a DataLoader's dataset so that a worker's exception reaches :class:`LoaderIterator` intact."""
    return _Guarded(stream)


def worker_init(worker_id: int) -> None:
    """``worker_init_fn`` of every loader: put the worker in its own process group.

    torchrun signals a worker's whole process group and a terminal's Ctrl-C the foreground group; a loader
    worker killed by them would make the main process fail mid-step instead of finishing the step and
    checkpointing. Out of that group the worker keeps SIGTERM's default action, so ``multiprocessing`` and
    the DataLoader can still end it (a worker that ignored SIGTERM could hang a process at exit). A worker
    whose main process dies ends by itself (the DataLoader's watchdog, within seconds).
    """
    try:
        os.setpgid(0, 0)
    except OSError:  # cannot leave the group: ignore the group's stop signals instead
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# Iterators with workers that may still be running; closed by close_all_loaders() (and at exit).
_LIVE: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def close_all_loaders() -> None:
    """Shut down the workers of every loader iterator still open in this process (before ``os._exit``, and
    at interpreter exit: registered with ``atexit`` after ``multiprocessing`` and torch, so it runs first)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for it in live:
        it.close()


def _track(it: LoaderIterator) -> None:
    global _ATEXIT_REGISTERED
    with _LIVE_LOCK:
        _LIVE.add(it)
        if not _ATEXIT_REGISTERED:
            atexit.register(close_all_loaders)
            _ATEXIT_REGISTERED = True


def _shutdown(it: Any, owner: int) -> None:
    # Only in the process that started the workers: a forked child (another loader's worker) holds copies of
    # this process's iterators, whose queues and events are the real ones.
    shutdown = getattr(it, "_shutdown_workers", None)  # _MultiProcessingDataLoaderIter's
    if shutdown is not None and os.getpid() == owner:
        shutdown()


class LoaderIterator:
    """An iterator of a :class:`Loader`: raises a worker's exception as the original one, after shutting the
    workers down; ``close()`` (or ``with``, or dropping it) shuts them down early."""

    def __init__(self, it: Iterator[Any], on_item: Callable[[Any], None] | None = None) -> None:
        self._it: Iterator[Any] | None = it
        self._on_item = on_item
        self._finalizer = weakref.finalize(self, _shutdown, it, os.getpid())
        self._finalizer.atexit = False  # close_all_loaders() runs first at exit
        _track(self)

    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            raise StopIteration
        try:
            item = next(self._it)
        except BaseException:  # the end, a worker that died, a signal: the workers go first
            self.close()
            raise
        if isinstance(item, WorkerFailure):
            self.close()
            raise item.exception()
        if self._on_item is not None:
            self._on_item(item)
        return item

    def close(self) -> None:
        """Shut the loader's workers down (idempotent); the iterator yields nothing more."""
        self._it = None
        self._finalizer()  # runs _shutdown once

    def __enter__(self) -> LoaderIterator:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Loader:
    """A DataLoader (``.dataloader``) whose iterators are :class:`LoaderIterator` s. ``close()`` (or the end
    of a ``with`` block) shuts down the workers of every iterator it made."""

    def __init__(self, dataloader: DataLoader) -> None:
        self.dataloader = dataloader
        self._iterators: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()

    def on_item(self, item: Any) -> None:
        """Called in the main process with each item, in order (a hook for subclasses)."""

    def __iter__(self) -> LoaderIterator:
        hook = self.on_item if type(self).on_item is not Loader.on_item else None
        it = LoaderIterator(iter(self.dataloader), hook)
        self._iterators.add(it)
        return it

    def close(self) -> None:
        for it in list(self._iterators):
            it.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
