"""Producer de-duplication: a message id seen on a topic within the window is not appended again.

ActiveMQ's message audit and Kafka's idempotent producer keep the same
promise: a producer that resends after a lost reply (same message id) gets
the first copy's placement back. Ids live in memory for ``window`` seconds
(at most ``entries`` of them); after a restart the store's id index answers.
"""

from __future__ import annotations

from collections import OrderedDict

from broker.delivery.values import Placement
from broker.store import Clock


class DedupWindow:
    """Recently published message ids and where they went."""

    def __init__(self, clock: Clock, window: float, entries: int) -> None:
        self._clock = clock
        self._window = window
        self._entries = entries
        self._seen: OrderedDict[tuple[str, str], tuple[float, Placement]] = OrderedDict()

    def get(self, topic: str, message_id: str) -> Placement | None:
        found = self._seen.get((topic, message_id))
        if found is None:
            return None
        if self._clock.time() - found[0] > self._window:
            return None
        return found[1]

    def add(self, placement: Placement) -> None:
        key = (placement.topic, placement.message_id)
        self._seen[key] = (self._clock.time(), placement)
        self._seen.move_to_end(key)
        horizon = self._clock.time() - self._window
        while self._seen and (len(self._seen) > self._entries
                              or next(iter(self._seen.values()))[0] < horizon):
            self._seen.popitem(last=False)
