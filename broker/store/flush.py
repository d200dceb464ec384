"""`Flusher`: fsyncs the commit log and tracks how far the fsyncs reach.

Writers write under the store's lock and tell the flusher how far the log now
reaches. Under `sync` the group committer calls `sync` right after writing a
generation, on its own thread: one write, one fsync, then the whole generation
is woken (no hand-over to another thread, so no wait for the GIL between the
fsync and the ack). Under `async` the flusher's thread fsyncs every
``interval`` seconds or ``flush_bytes`` bytes; under `none` nothing fsyncs
(checkpoints still do).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from broker.errors import StoreError
from broker.store.config import FlushPolicy
from broker.store.segment import Segment

log = structlog.get_logger("broker.store")

FlushTarget = Callable[[int], Segment]
"""Returns the segment holding the last byte before a log offset (older ones were fsynced
when the log rolled past them)."""


class Flusher:
    """Tracks written and flushed log offsets; owns the `async` fsync thread."""

    def __init__(
        self, policy: FlushPolicy, interval: float, flush_bytes: int, target: FlushTarget, end: int
    ) -> None:
        self.policy = policy
        self.written = end
        self.flushed = end
        self._interval = interval
        self._flush_bytes = flush_bytes
        self._target = target
        self._cond = threading.Condition(threading.Lock())  # the thread waits here for work
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.on_fsync: Callable[[float], None] | None = None
        """Told the seconds each fsync took (a server's latency metric), on the fsyncing thread."""
        if policy is FlushPolicy.ASYNC:
            self._thread = threading.Thread(target=self._run, name="store-flusher", daemon=True)
            self._thread.start()

    def wrote(self, end: int) -> None:
        """The log now reaches ``end`` in the operating system's hands."""
        with self._cond:
            self.written = end
            if self._thread is not None and end - self.flushed >= self._flush_bytes:
                self._cond.notify()

    def sync(self, end: int) -> None:
        """Fsync the log up to ``end`` now (the caller's thread); raise `StoreError` if it fails."""
        if self._error is not None:
            raise _fsync_error(self._error)
        if self.flushed >= end:
            return
        began = time.perf_counter()
        try:
            self._target(end).fsync()
        except (OSError, StoreError) as exc:
            log.error("store.fsync_failed", error=repr(exc))
            self._error = exc
            raise _fsync_error(exc) from exc
        with self._cond:
            self.flushed = max(self.flushed, end)
        if self.on_fsync is not None:
            self.on_fsync(time.perf_counter() - began)

    def stop(self) -> None:
        """Flush what is left and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._stopping and self.written - self.flushed < self._flush_bytes:
                    self._cond.wait(self._interval)
                if self.written <= self.flushed:
                    if self._stopping:
                        return
                    continue
                end = self.written
            try:
                self.sync(end)
            except StoreError:
                return  # logged; `async` appends go on, checkpoints fsync too


def _fsync_error(cause: BaseException) -> StoreError:
    error = StoreError("the commit log could not be fsynced")
    error.__cause__ = cause
    return error
