"""Lag and topic sizes over the last hour: sampled in the background, drawn as an SVG polyline.

The broker keeps no history of lag, so the console samples it (every
``sample_interval`` seconds, for ``history`` seconds) and keeps the samples in
memory; a restarted console starts a new curve. Topic sizes sampled the same
way give each topic's publish rate.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from broker.console.sources import BrokerView
from broker.errors import BrokerError
from broker.store.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger("broker.console")
Sample = tuple[float, int]  # (the monotonic clock's seconds, value): only spans between them are drawn


class Series:
    """Samples of one value, the oldest dropped once they are older than ``keep`` seconds."""

    def __init__(self, keep: float) -> None:
        self.keep = keep
        self.samples: deque[Sample] = deque()

    def add(self, when: float, value: int) -> None:
        self.samples.append((when, value))
        while self.samples and self.samples[0][0] < when - self.keep:
            self.samples.popleft()

    def rate(self) -> float:
        """Growth per second between the first and last sample (0 with fewer than two)."""
        if len(self.samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return max(v1 - v0, 0) / (t1 - t0) if t1 > t0 else 0.0


class History:
    """Every group's total lag and every topic's message count, sampled from a `BrokerView`."""

    def __init__(self, view: BrokerView, interval: float, keep: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.view, self.interval, self.keep, self.clock = view, interval, keep, clock
        self.lag: dict[str, Series] = {}
        self.topics: dict[str, Series] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take one sample of everything (the background thread calls this every interval), timed
        on the monotonic clock: a wall clock step neither stretches a curve nor zeroes a rate."""
        now = self.clock.monotonic()
        lags = {g.name: sum(q.end - q.committed for q in self.view.lag(g.name)) for g in self.view.groups()}
        sizes = {t.name: t.messages for t in self.view.topics()}
        with self._lock:
            for table, values in ((self.lag, lags), (self.topics, sizes)):
                for name, value in values.items():
                    table.setdefault(name, Series(self.keep)).add(now, value)

    def lag_of(self, group: str) -> list[Sample]:
        with self._lock:
            return list(self.lag.get(group, Series(self.keep)).samples)

    def rate_of(self, topic: str) -> float:
        with self._lock:
            series = self.topics.get(topic)
            return series.rate() if series else 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="console-history", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except (BrokerError, OSError) as exc:
                log.warning("console.sample_failed", error=str(exc))
            self._stop.wait(self.interval)


@dataclass(frozen=True)
class Plot:
    """A polyline's points in a ``width`` x ``height`` box, with the value range it spans."""

    points: str
    width: int
    height: int
    top: int
    seconds: float


def plot(samples: Sequence[Sample], width: int = 640, height: int = 160) -> Plot | None:
    """The samples scaled into the box (time across, lag up); None with fewer than two."""
    if len(samples) < 2:
        return None
    t0, t1 = samples[0][0], samples[-1][0]
    top = max(max(v for _, v in samples), 1)
    span = max(t1 - t0, 1e-9)
    points = " ".join(f"{(t - t0) / span * width:.1f},{height - v / top * height:.1f}" for t, v in samples)
    return Plot(points, width, height, top, t1 - t0)
