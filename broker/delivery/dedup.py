"""Producer de-duplication: a message id seen on a topic within the window is not appended again.

ActiveMQ's message audit and Kafka's idempotent producer keep the same
promise: a producer that resends after a lost reply (same message id) gets
the first copy's placement back. Ids live in memory for ``window`` seconds;
after a restart the store's id index answers.

A publish whose messages carry ids runs this for every message: it asks
about and adds its whole batch with dict
operations in C, and old ids go a generation at a time (as ActiveMQ's audit
drops a whole window), never one by one. New ids go into the current
generation; once it has filled for ``window`` seconds or holds ``entries``
ids it becomes the previous one, and the previous one is dropped. So an id
is found for ``window`` seconds unless ``entries`` ids came after it, and at
most twice ``entries`` are held.

A batch named by a batch id (`broker.store.runs`: its messages' ids are
``<batch id>.0 ...``) is one entry, its placements kept as the columns the store
returned: one dict operation per batch instead of three per message. It counts
as many ids as it has messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from broker.delivery.values import Placement
from broker.errors import DeliveryError
from broker.store import Clock

Seen = dict[str, tuple[float, int, int]]  # message id -> (when added, queue, offset), of one topic
Batches = dict[str, tuple[float, Sequence[int], Sequence[int]]]  # batch_id -> (when, queues, offsets)


class DedupWindow:
    """Recently published message ids and where they went."""

    def __init__(self, clock: Clock, window: float, entries: int) -> None:
        self._clock = clock
        self._window = window
        self._entries = entries
        self._current: dict[str, Seen] = {}  # by topic
        self._previous: dict[str, Seen] = {}
        self._current_batches: dict[str, Batches] = {}  # by topic, rotated with the ids
        self._previous_batches: dict[str, Batches] = {}
        self._began = clock.monotonic()  # when the current generation took its first id
        self._held = 0  # ids added to the current generation

    def get(self, topic: str, message_id: str) -> Placement | None:
        """Where ``message_id`` went on ``topic``, if published within the window."""
        return self.find(topic, [message_id])[0]

    def find(self, topic: str, message_ids: Sequence[str]) -> list[Placement | None]:
        """`get` for each of ``message_ids``."""
        current, previous = self._current.get(topic, {}), self._previous.get(topic, {})
        found = list(map(current.get, message_ids))
        if previous:
            found = [seen or previous.get(message_id) for seen, message_id in zip(found, message_ids)]
        if found.count(None) == len(found):
            return [None] * len(found)  # the usual batch: ids not seen
        horizon = self._clock.monotonic() - self._window
        return [Placement(topic, seen[1], seen[2], message_id) if seen and seen[0] >= horizon else None
                for seen, message_id in zip(found, message_ids)]

    def add(self, topic: str, queues: Sequence[int], offsets: Sequence[int],
            message_ids: Sequence[str]) -> None:
        """Remember that ``message_ids`` went to ``queues`` at ``offsets`` (one of each per id)."""
        now = self._rotated()
        seen = self._current.get(topic)
        if seen is None:
            seen = self._current[topic] = {}
        seen.update(zip(message_ids, zip(repeat(now), queues, offsets)))
        self._held += len(message_ids)

    def find_batch(self, topic: str, batch_id: str,
                   count: int) -> tuple[Sequence[int], Sequence[int]] | None:
        """The queues and offsets the batch ``batch_id`` of ``count`` messages went to, if published
        on ``topic`` within the window; `DeliveryError` if it had another count (a batch id names one
        batch: a resend is the same batch)."""
        seen = (self._current_batches.get(topic, {}).get(batch_id)
                or self._previous_batches.get(topic, {}).get(batch_id))
        if seen is None or seen[0] < self._clock.monotonic() - self._window:
            return None
        if len(seen[1]) != count:
            raise DeliveryError(f"batch {batch_id!r} was published on {topic} with {len(seen[1])} "
                                f"messages; this one has {count} (a resend must be the same batch)")
        return seen[1], seen[2]

    def add_batch(self, topic: str, batch_id: str, queues: Sequence[int], offsets: Sequence[int]) -> None:
        """Remember that the batch ``batch_id`` went to ``queues`` at ``offsets``."""
        now = self._rotated()
        batches = self._current_batches.get(topic)
        if batches is None:
            batches = self._current_batches[topic] = {}
        batches[batch_id] = (now, queues, offsets)
        self._held += len(queues)

    def _rotated(self) -> float:
        """The time now, after starting a new generation if the current one is full or old."""
        now = self._clock.monotonic()
        if self._held >= self._entries or now - self._began >= self._window:
            self._previous, self._current = self._current, {}
            self._previous_batches, self._current_batches = self._current_batches, {}
            self._began, self._held = now, 0
        return now
