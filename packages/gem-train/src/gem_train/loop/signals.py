"""SIGTERM/SIGINT during a run: the first one asks the run to stop after the step (and checkpoint), a
second one stops it at once (:class:`StopNow`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gem_train.loop.distributed import DistInfo, any_rank

__all__ = ["StopNow", "StopSignals"]


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT while the first is being handled: the run stops at once, without a
    checkpoint (the newest complete one stays). ``signum`` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"second {signal.Signals(signum).name}: stopped at once")
        self.signum = signum


class StopSignals:
    """Records the first SIGTERM/SIGINT (``received``); raises :class:`StopNow` on the second."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise StopNow(signum)  # a second signal: stop now, without a checkpoint
        self.received = signum

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers, for the duration of the block (only in the main thread: signals go there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def should_stop(self, d: DistInfo) -> bool:
        """Whether any rank received a signal (collective: all ranks stop at the same step)."""
        return any_rank(self.received is not None, d)

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "signal"
