"""What an operator asks of the engine: topics, groups, lag, and the dead-letter queues.

The listings are functions of the parts they read (the store, the topic
table, the offset book, the live groups), which `Broker` hands them under
its lock; `DeadLetters` owns the dead-letter queues ``%DLQ%<group>`` and
their purge marks, kept in the offset book under the pseudo-group
``%ADMIN%``. Neither reaches into the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from broker.delivery.group import ORIGIN_TOPIC, Group, dlq_topic, retry_topic
from broker.delivery.offsets import OffsetBook
from broker.delivery.values import Delivery, GroupInfo, OutgoingMessage, QueueLag, TopicInfo
from broker.store import MessageStore

ADMIN = "%ADMIN%"


def topics(store: MessageStore, known: Mapping[str, int]) -> list[TopicInfo]:
    """Every topic of ``known`` (its queue count by name) with how many messages it keeps, and
    the bytes they take in the log (each queue's running total: nothing is read)."""
    return [TopicInfo(name, count, sum(store.max_offset(name, q) - store.min_offset(name, q)
                                       for q in range(count)),
                      sum(store.kept_bytes(name, q) for q in range(count)))
            for name, count in sorted(known.items())]


def groups(offsets: OffsetBook, live_groups: Mapping[str, Group]) -> list[GroupInfo]:
    names = (set(offsets.groups()) | set(live_groups)) - {ADMIN}
    found = []
    for name in sorted(names):
        live = live_groups.get(name)
        read = {t for (t, _) in offsets.of_group(name)} | set(live.topics() if live else ())
        found.append(GroupInfo(name, tuple(sorted(read)), len(live.members) if live else 0,
                               bool(live and live.broadcast)))
    return found


def lag(store: MessageStore, offsets: OffsetBook, group: str, live: Group | None) -> list[QueueLag]:
    positions = dict(offsets.of_group(group))
    if live is not None and not live.broadcast:
        positions.update({key: cursor.committed for key, cursor in live.cursors.items()})
    return [QueueLag(topic, queue, committed, store.max_offset(topic, queue))
            for (topic, queue), committed in sorted(positions.items())
            if topic != retry_topic(group) or committed < store.max_offset(topic, queue)]


class DeadLetters:
    """The dead-letter queues of every group: listed from their purge mark, purged, replayed.

    ``publish_to_group`` sends a replayed letter back to its group only; ``lock`` guards the
    offset book the marks live in (the engine's, which other parts write too).
    """

    def __init__(self, store: MessageStore, offsets: OffsetBook, lock: AbstractContextManager[Any],
                 publish_to_group: Callable[[str, str, Sequence[OutgoingMessage]], Any]) -> None:
        self._store = store
        self._offsets = offsets
        self._lock = lock
        self._publish_to_group = publish_to_group

    def _mark(self, group: str) -> int:
        saved = self._offsets.get((ADMIN, dlq_topic(group), 0))
        return saved if saved is not None else self._store.min_offset(dlq_topic(group), 0)

    def list(self, group: str, limit: int) -> list[Delivery]:
        """The dead letters of ``group`` not purged, oldest first (cause in ``x-dlq-cause``)."""
        with self._lock:
            stored = self._store.read(dlq_topic(group), 0, self._mark(group), max_count=limit)
        return [Delivery("", m.topic, m.queue, m.queue_offset, m.message_id, m.body, m.key, m.tag,
                         dict(m.headers), m.attempt, m.store_time) for m in stored]

    def purge(self, group: str) -> int:
        with self._lock:
            end = self._store.max_offset(dlq_topic(group), 0)
            purged = end - self._mark(group)
            self._offsets.put((ADMIN, dlq_topic(group), 0), end)
        self._offsets.flush()
        return purged

    def replay(self, group: str) -> int:
        """Publish every dead letter back to ``group`` only (its original topic named), then purge."""
        replayed = 0
        while letters := self.list(group, 500):
            by_topic: dict[str, list[OutgoingMessage]] = {}
            for letter in letters:
                topic = letter.headers.get(ORIGIN_TOPIC, letter.topic)
                headers = {k: v for k, v in letter.headers.items() if not k.startswith("x-dlq-")}
                by_topic.setdefault(topic, []).append(
                    OutgoingMessage(letter.body, letter.key, letter.tag, headers))
            for topic, messages in by_topic.items():
                self._publish_to_group(group, topic, messages)
            with self._lock:
                self._offsets.put((ADMIN, dlq_topic(group), 0), letters[-1].offset + 1)
            replayed += len(letters)
        self._offsets.flush()
        return replayed
