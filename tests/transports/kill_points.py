"""Where the kill -9 runs (`tests/transports/chaos.py`, `outbox_chain.py`, `test_kafka_rebalance.py`,
`tests/framework/test_transport_faults.py`, `test_exactly_once.py`) place their kills: by the work's
progress, and all before the work can end.

A run kills its victims ``kills`` times while a producer's messages are
worked through. Placed by time, or by an amount of progress counted from
the previous kill, the kills drift behind the work on a loaded machine: the
time a kill and a restart take is not counted, the work goes on meanwhile,
and the Kafka outbox chain finished before most of its 20 kills in 2 of 7
CI runs. Here the producer holds its last `HELD_BACK` messages back until
the last kill, so the work cannot end before any kill; and the kills are
placed at points of the rest of the work (`points`): one at a random point
of each of ``kills + 1`` equal slices of it but the last, each kill waiting
until its victim's progress reached its point (and a random moment more).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

HELD_BACK = 500
"""Messages a kill -9 run's producer sends only after the last kill (one of its batches of 500)."""

JITTER = 0.1
"""The most seconds a kill waits past its point: it lands at a random moment of the work, not on a poll."""


def held_back(messages: Sequence[T]) -> tuple[Sequence[T], Sequence[T]]:
    """``messages`` split in what is sent at once and what only after the last kill (`HELD_BACK`)."""
    return messages[:-HELD_BACK], messages[-HELD_BACK:]


def points(kills: int, work: int, rng: random.Random) -> list[int]:
    """``kills`` amounts of progress, ascending, at which the kills land: one at a random point of each
    of ``kills + 1`` equal slices of ``work``, none in the last (the kills cover the work, not its end)."""
    return [int(work * (slice_ + rng.random()) / (kills + 1)) for slice_ in range(kills)]

