"""Which queue of a topic a message without a key or an asked-for queue goes to.

Two selectors, named by the ``selection`` setting:

* ``round_robin`` (`RoundRobin`): each topic's queues in turn.
* ``latency_aware`` (`LatencyAware`): RocketMQ's ``MQFaultStrategy`` (its
  producer's ``sendLatencyFaultEnable``). Every append's latency is recorded
  for each queue it wrote to; a latency at or above one of the
  `LatencyTable`'s thresholds pauses the queue for the matching duration
  (RocketMQ's ``latencyMax`` / ``notAvailableDuration``), and a failed append
  counts as the worst latency. Round robin then goes over the queues that
  are not paused; when every queue is paused, the least bad one (its pause
  ends first) takes the messages.

A message with a key is placed by key hash whatever the selector, so the
order per key holds (RocketMQ's selector with a key ignores latency too);
a message that asks for a queue gets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from broker.store import Clock

#: RocketMQ's MQFaultStrategy tables, in seconds: a latency >= ``latency_max[i]`` pauses the
#: queue for ``not_available_duration[i]``
LATENCY_MAX = (0.05, 0.1, 0.55, 1.0, 2.0, 3.0, 15.0)
NOT_AVAILABLE_DURATION = (0.0, 0.0, 30.0, 60.0, 120.0, 180.0, 600.0)


class QueueSelector(Protocol):
    """Spreads messages over a topic's queues, and may learn from how appends went."""

    measures: bool
    """Whether appends should be timed and reported (`appended`, `failed`)."""

    def spread(self, topic: str, count: int, taken: int) -> list[int]:
        """The queues (of ``count``) for the next ``taken`` messages of ``topic``."""

    def appended(self, topic: str, queues: Iterable[int], latency: float) -> None:
        """An append to ``queues`` of ``topic`` took ``latency`` seconds."""

    def failed(self, topic: str, queues: Iterable[int]) -> None:
        """An append to ``queues`` of ``topic`` failed."""


class RoundRobin:
    """Each topic's queues in turn."""

    measures = False

    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # the next turn per topic

    def turns(self, topic: str, taken: int) -> range:
        """The next ``taken`` turns of ``topic`` (ever-growing numbers)."""
        first = self._next.get(topic, 0)
        self._next[topic] = first + taken
        return range(first, first + taken)

    def spread(self, topic: str, count: int, taken: int) -> list[int]:
        return [turn % count for turn in self.turns(topic, taken)]

    def appended(self, topic: str, queues: Iterable[int], latency: float) -> None:
        pass

    def failed(self, topic: str, queues: Iterable[int]) -> None:
        pass


@dataclass(frozen=True)
class LatencyTable:
    """How long a queue is avoided after an append this slow: ``latency >= latency_max[i]``
    pauses it for ``not_available_duration[i]`` seconds (the last match wins)."""

    latency_max: tuple[float, ...] = LATENCY_MAX
    not_available_duration: tuple[float, ...] = NOT_AVAILABLE_DURATION

    def pause(self, latency: float) -> float:
        for threshold, duration in zip(reversed(self.latency_max), reversed(self.not_available_duration)):
            if latency >= threshold:
                return duration
        return 0.0

    @property
    def worst(self) -> float:
        """The latency a failed append counts as."""
        return self.latency_max[-1]


@dataclass
class _Fault:
    latency: float
    until: float  # clock time at which the queue is available again


class LatencyAware:
    """Round robin over the queues not paused by a slow or failed append (RocketMQ's
    MQFaultStrategy); the least bad queue when every one is paused."""

    measures = True

    def __init__(self, clock: Clock, table: LatencyTable | None = None) -> None:
        self._clock = clock
        self._table = table or LatencyTable()
        self._round_robin = RoundRobin()
        self._faults: dict[str, dict[int, _Fault]] = {}  # paused queues per topic

    def spread(self, topic: str, count: int, taken: int) -> list[int]:
        turns = self._round_robin.turns(topic, taken)
        paused = self._paused(topic, count)
        if not paused:
            return [turn % count for turn in turns]
        available = [queue for queue in range(count) if queue not in paused]
        if not available:
            least_bad = min(paused, key=lambda queue: (paused[queue].until, paused[queue].latency, queue))
            return [least_bad] * taken
        return [available[turn % len(available)] for turn in turns]

    def appended(self, topic: str, queues: Iterable[int], latency: float) -> None:
        latency = max(latency, 0.0)  # a clock set back is not a fast append's fault
        pause = self._table.pause(latency)
        faults = self._faults.setdefault(topic, {})
        if pause <= 0:
            for queue in queues:
                faults.pop(queue, None)
            return
        until = self._clock.monotonic() + pause
        for queue in queues:
            faults[queue] = _Fault(latency, until)

    def failed(self, topic: str, queues: Iterable[int]) -> None:
        self.appended(topic, queues, self._table.worst)

    def paused(self, topic: str) -> dict[int, float]:
        """The paused queues of ``topic`` and until when (the monotonic clock's; for inspection)."""
        return {queue: fault.until for queue, fault in self._faults.get(topic, {}).items()
                if fault.until > self._clock.monotonic()}

    def _paused(self, topic: str, count: int) -> dict[int, _Fault]:
        """The queues of ``topic`` still paused now; ended pauses are forgotten."""
        faults = self._faults.get(topic)
        if not faults:
            return {}
        now = self._clock.monotonic()
        for queue in [queue for queue, fault in faults.items() if fault.until <= now or queue >= count]:
            del faults[queue]
        return faults

