"""Operators on one dead-letter queue at once: two replays, a replay and a purge.

`Racing` is the engine with a meeting point in `publish_to_group`, which a
replay calls once per 500 letters: each replay's first send waits there for
the other side, so the race happens on every run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from broker.delivery import lookup
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage, Placement
from broker.store import FakeClock, StoreConfig
from tests.broker.delivery.conftest import drain, messages

LETTERS = 1_500  # three of a replay's steps of 500


class Racing(Broker):
    """The engine; the first send back of each replay thread calls ``meet`` first."""

    meet: Callable[[], Any] = staticmethod(lambda: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent = threading.local()

    def publish_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        if not getattr(self._sent, "once", False):
            self._sent.once = True
            self.meet()
        return super().publish_to_group(group, topic, messages)


def dead_letter_all(broker: Broker, count: int) -> None:
    """Publish ``count`` messages to orders and dead-letter each from group billing."""
    broker.publish("orders", messages(count))
    billing = broker.join("billing", ["orders"])
    while deliveries := broker.fetch(billing, 100, 0):
        broker.dead_letter(billing, [d.receipt for d in deliveries], "bad")
    broker.leave(billing)
    assert lookup.dlq_waiting(broker, "billing") == count


@pytest.fixture
def broker(tmp_path: Path, clock: FakeClock) -> Iterator[Racing]:
    opened = Racing(tmp_path / "broker", store_config=StoreConfig(clock=clock), clock=clock)
    dead_letter_all(opened, LETTERS)
    yield opened
    opened.close()


def test_two_replays_at_once_send_each_letter_once(broker: Racing) -> None:
    """Both replays used to list the same 500 letters and send them: 1,000 of 1,500 went twice."""
    broker.meet = threading.Barrier(2, timeout=30).wait  # each sends while the other is sending
    with ThreadPoolExecutor(2) as pool:
        replayed = list(pool.map(lambda _: broker.dlq_replay("billing"), range(2)))
    assert sum(replayed) == LETTERS and min(replayed) > 0, replayed
    billing = broker.join("billing", ["orders"])
    assert len(drain(broker, billing)) == LETTERS
    assert broker.dlq_list("billing") == [] and lookup.dlq_waiting(broker, "billing") == 0


def test_a_purge_while_a_replay_sends_is_not_undone(broker: Racing) -> None:
    """The replay used to put its mark back below the purge's and replay every purged letter."""
    sending, purged = threading.Event(), threading.Event()
    broker.meet = lambda: (sending.set(), purged.wait(30))
    with ThreadPoolExecutor(1) as pool:
        replay = pool.submit(broker.dlq_replay, "billing")
        assert sending.wait(30)
        purged_count = broker.dlq_purge("billing")
        purged.set()
        replayed = replay.result(timeout=30)
    billing = broker.join("billing", ["orders"])
    assert len(drain(broker, billing)) == 500
    assert (replayed, purged_count) == (500, LETTERS - 500)  # the 500 on their way back were not purged
    assert broker.dlq_list("billing") == [] and lookup.dlq_waiting(broker, "billing") == 0
