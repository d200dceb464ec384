"""Operator reads the engine's `BrokerApi` has no call for: a message by key or id, a DLQ's size.

A message is found through the store's key index (RocketMQ's query by key):
by its key within a store-time range of one topic, or by its message id.
That needs the store, so it works where the engine runs in this process (the
server, or an embedded directory nobody else owns). The number of dead
letters waiting in ``%DLQ%<group>`` is the queue's end minus the purge mark
the engine keeps under the pseudo-group ``%ADMIN%`` (`broker.delivery.admin`).
"""

from __future__ import annotations

from typing import Any

from broker.delivery.admin import ADMIN, DeadLetters
from broker.delivery.group import dlq_topic
from broker.delivery.values import Delivery
from broker.errors import BrokerError
from broker.store import MessageStore
from broker.store.record import StoredMessage

DEFAULT_LIMIT = 64


def by_key(api: Any, topic: str, key: str, begin: float, end: float,
           limit: int = DEFAULT_LIMIT) -> list[Delivery]:
    """The messages of ``topic`` with ``key`` stored between ``begin`` and ``end`` (epoch seconds)."""
    if begin > end or limit < 1:
        raise BrokerError(f"lookup of key {key!r}: begin {begin} must be <= end {end}, "
                          f"limit {limit} >= 1")
    return [_delivery(m) for m in _store(api).lookup_key(topic, key, begin, end, limit)]


def by_id(api: Any, message_id: str) -> Delivery | None:
    """The message with ``message_id``, if the store still holds it."""
    found = _store(api).lookup_id(message_id)
    return None if found is None else _delivery(found)


def dlq_waiting(api: Any, group: str) -> int:
    """How many dead letters of ``group`` are neither replayed nor purged."""
    dead_letters = getattr(getattr(api, "engine", api), "dead_letter_queues", None)
    if isinstance(dead_letters, DeadLetters):  # the engine is here: it knows the letters settled one by one
        return dead_letters.waiting(group)
    topic = dlq_topic(group)
    if not any(t.name == topic for t in api.topics()):
        return 0
    first, end = api.queue_offsets(topic)[0]
    mark = api.group_offsets(ADMIN, topic)[0]
    return int(end - (first if mark is None else max(mark, first)))


def _store(api: Any) -> MessageStore:
    store = getattr(api, "store", None)
    if not isinstance(store, MessageStore):
        raise BrokerError("message lookup needs the engine in this process "
                          "(a broker server, or an embedded directory no other process owns)")
    return store


def _delivery(m: StoredMessage) -> Delivery:
    return Delivery("", m.topic, m.queue, m.queue_offset, m.message_id, m.body, m.key, m.tag,
                    dict(m.headers), m.attempt + 1, m.store_time)
