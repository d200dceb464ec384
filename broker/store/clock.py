"""Injected time for the store: it asks a `Clock` for the time, never `time` itself."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch."""


class SystemClock:
    """The real wall clock."""

    def time(self) -> float:
        return time.time()


class FakeClock:
    """A clock that only moves when told to; thread-safe, for tests."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def time(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()
