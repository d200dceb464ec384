"""`Flusher`: the thread that fsyncs the commit log, and group commit for `sync` appends.

Writers write under the store's lock and tell the flusher how far the log now
reaches. Under `sync` they then wait for a flushed offset at or past their own:
the flusher takes the current end, runs one fsync (other producers keep
writing meanwhile), and wakes every waiter it covered — many producers, one
fsync. Under `async` it fsyncs every ``interval`` seconds or ``flush_bytes``
bytes; under `none` it never runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from broker.errors import StoreClosedError, StoreError
from broker.store.config import FlushPolicy
from broker.store.segment import Segment

log = structlog.get_logger("broker.store")

FlushTarget = Callable[[int], Segment]
"""Returns the segment holding the last byte before a log offset (older ones were fsynced
when the log rolled past them)."""


class Flusher:
    """Tracks written and flushed log offsets; owns the fsync thread."""

    def __init__(
        self, policy: FlushPolicy, interval: float, flush_bytes: int, target: FlushTarget, end: int
    ) -> None:
        self.policy = policy
        self.written = end
        self.flushed = end
        self._interval = interval
        self._flush_bytes = flush_bytes
        self._target = target
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the flusher waits here for work
        self._flushed = threading.Condition(lock)  # producers wait here for their fsync
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if policy is not FlushPolicy.NONE:
            self._thread = threading.Thread(target=self._run, name="store-flusher", daemon=True)
            self._thread.start()

    def wrote(self, end: int) -> None:
        """The log now reaches ``end`` in the operating system's hands."""
        with self._cond:
            self.written = end
            if self.policy is FlushPolicy.SYNC or end - self.flushed >= self._flush_bytes:
                self._cond.notify()

    def wait(self, end: int) -> None:
        """Block until an fsync has covered ``end`` (the ack of a `sync` append)."""
        with self._cond:
            while self.flushed < end:
                if self._error is not None:
                    raise StoreError("the commit log could not be fsynced") from self._error
                if self._stopping:
                    raise StoreClosedError("the store closed before the append was flushed")
                self._flushed.wait()

    def stop(self) -> None:
        """Flush what is left and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._flushed.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        sync = self.policy is FlushPolicy.SYNC
        while True:
            with self._cond:
                if sync:
                    while not self._stopping and self.written <= self.flushed:
                        self._cond.wait()
                elif not self._stopping and self.written - self.flushed < self._flush_bytes:
                    self._cond.wait(self._interval)
                if self.written <= self.flushed:
                    if self._stopping:
                        return
                    continue
                end = self.written
            try:
                self._target(end).fsync()
            except (OSError, StoreError) as exc:  # handed to every waiting producer
                log.error("store.fsync_failed", error=repr(exc))
                with self._cond:
                    self._error = exc
                    self._stopping = True
                    self._flushed.notify_all()
                return
            with self._cond:
                self.flushed = max(self.flushed, end)
                self._flushed.notify_all()
