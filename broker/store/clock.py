"""Injected time for the store: it asks a `Clock` for the time, never `time` itself."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Two readings: ``time`` is the wall clock, for timestamps stored or compared across
    processes (store times, due times in the log, retention by age); ``monotonic`` never steps
    (an NTP correction, a resumed VM), for durations and deadlines inside one process (leases,
    heartbeats, session timeouts, lock-outs)."""

    def time(self) -> float:
        """Seconds since the epoch (wall time: it may step)."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary start, never stepping: what a duration is measured with."""


class SystemClock:
    """The real clocks: the wall clock and the monotonic one."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that only moves when told to; thread-safe, for tests. ``advance`` moves both
    readings; ``step`` moves the wall clock alone, as an NTP correction or a resumed VM does."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._elapsed = 1_000_000.0  # a machine up for a while: no reading near zero
        self._lock = threading.Lock()

    def time(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._elapsed

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self._elapsed += max(seconds, 0.0)

    def step(self, seconds: float) -> None:
        """The wall clock jumps by ``seconds`` (back when negative); the monotonic one stays."""
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()
