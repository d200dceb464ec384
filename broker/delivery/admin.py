"""What an operator asks of the engine: topics, groups, lag, and the dead-letter queues.

Called by `Broker` with its lock held (except `dlq_replay`, which publishes).
A dead-letter queue ``%DLQ%<group>`` is read from the group's purge mark,
kept in the offset book under the pseudo-group ``%ADMIN%``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.delivery.consume import ORIGIN_TOPIC
from broker.delivery.group import dlq_topic, retry_topic
from broker.delivery.values import Delivery, GroupInfo, OutgoingMessage, QueueLag, TopicInfo

if TYPE_CHECKING:
    from broker.delivery.engine import Broker

ADMIN = "%ADMIN%"


def topics(broker: Broker) -> list[TopicInfo]:
    store = broker.store
    return [TopicInfo(name, count, sum(store.max_offset(name, q) - store.min_offset(name, q)
                                       for q in range(count)))
            for name, count in sorted(broker.topic_table.known().items())]


def groups(broker: Broker) -> list[GroupInfo]:
    names = (set(broker.offsets.groups()) | set(broker.group_table)) - {ADMIN}
    found = []
    for name in sorted(names):
        live = broker.group_table.get(name)
        read = {t for (t, _) in broker.offsets.of_group(name)} | set(live.topics() if live else ())
        found.append(GroupInfo(name, tuple(sorted(read)), len(live.members) if live else 0,
                               bool(live and live.broadcast)))
    return found


def lag(broker: Broker, group: str) -> list[QueueLag]:
    live = broker.group_table.get(group)
    positions = dict(broker.offsets.of_group(group))
    if live is not None and not live.broadcast:
        positions.update({key: cursor.committed for key, cursor in live.cursors.items()})
    return [QueueLag(topic, queue, committed, broker.store.max_offset(topic, queue))
            for (topic, queue), committed in sorted(positions.items())
            if topic != retry_topic(group) or committed < broker.store.max_offset(topic, queue)]


def _mark(broker: Broker, group: str) -> int:
    saved = broker.offsets.get((ADMIN, dlq_topic(group), 0))
    return saved if saved is not None else broker.store.min_offset(dlq_topic(group), 0)


def dlq_list(broker: Broker, group: str, limit: int) -> list[Delivery]:
    """The dead letters of ``group`` not purged, oldest first (cause in ``x-dlq-cause``)."""
    stored = broker.store.read(dlq_topic(group), 0, _mark(broker, group), max_count=limit)
    return [Delivery("", m.topic, m.queue, m.queue_offset, m.message_id, m.body, m.key, m.tag,
                     dict(m.headers), m.attempt, m.store_time) for m in stored]


def dlq_purge(broker: Broker, group: str) -> int:
    end = broker.store.max_offset(dlq_topic(group), 0)
    purged = end - _mark(broker, group)
    broker.offsets.put((ADMIN, dlq_topic(group), 0), end)
    broker.offsets.flush()
    return purged


def dlq_replay(broker: Broker, group: str) -> int:
    """Publish every dead letter back to ``group`` only (its original topic named), then purge."""
    replayed = 0
    while letters := dlq_list(broker, group, 500):
        by_topic: dict[str, list[OutgoingMessage]] = {}
        for letter in letters:
            topic = letter.headers.get(ORIGIN_TOPIC, letter.topic)
            headers = {k: v for k, v in letter.headers.items() if not k.startswith("x-dlq-")}
            by_topic.setdefault(topic, []).append(
                OutgoingMessage(letter.body, letter.key, letter.tag, headers))
        for topic, messages in by_topic.items():
            broker.publish_to_group(group, topic, messages)
        with broker.lock:
            broker.offsets.put((ADMIN, dlq_topic(group), 0), letters[-1].offset + 1)
        replayed += len(letters)
    broker.offsets.flush()
    return replayed

