"""Injected time: core code asks a `Clock` for the time and to sleep, never `time` itself."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Two readings: ``time`` is the wall clock, for timestamps stored or compared across
    processes; ``monotonic`` never steps (an NTP correction, a resumed VM), for durations and
    deadlines inside one process."""

    def time(self) -> float:
        """Seconds since the epoch (wall time: it may step)."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary start, never stepping: what a duration is measured with."""

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds`` (a fake clock advances instead)."""


class SystemClock:
    """The real clocks: the wall clock and the monotonic one."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that only moves when told to, or when something sleeps on it.

    Thread-safe; ``sleeps`` records every requested sleep so tests can assert
    on backoff delays. ``advance`` and ``sleep`` move both readings; ``step`` moves the wall
    clock alone, as an NTP correction or a resumed VM does.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._elapsed = 1_000_000.0  # a machine up for a while: no reading near zero
        self._lock = threading.Lock()
        self.sleeps: list[float] = []

    def time(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._elapsed

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            self._now += max(seconds, 0.0)
            self._elapsed += max(seconds, 0.0)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self._elapsed += max(seconds, 0.0)

    def step(self, seconds: float) -> None:
        """The wall clock jumps by ``seconds`` (back when negative); the monotonic one stays."""
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()


def wait_unless(clock: Clock, seconds: float, stopping: threading.Event | None) -> None:
    """Wait ``seconds`` on ``clock``, cut short when ``stopping`` is set (a stopping worker does
    not sit out a backoff): the wall clock waits on the event; any other clock (a fake one
    advances at once) sleeps unless ``stopping`` is already set."""
    if stopping is None:
        clock.sleep(seconds)
    elif isinstance(clock, SystemClock):
        stopping.wait(max(seconds, 0.0))
    elif not stopping.is_set():
        clock.sleep(seconds)


async def pause(clock: Clock, seconds: float) -> None:
    """Wait ``seconds`` on ``clock`` from a coroutine: the wall clock without blocking the event
    loop (``asyncio.sleep``); any other clock (a fake one advances at once) through its ``sleep``."""
    if isinstance(clock, SystemClock):
        if seconds > 0:
            await asyncio.sleep(seconds)
    else:
        clock.sleep(seconds)
