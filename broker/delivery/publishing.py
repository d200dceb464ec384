"""The publishing half of `Broker`: records into the store, de-duplicated by message id.

A publish becomes one append to the store: each message gets the queue the
topic table selects for it (asked for, by key hash, else the topic's queue
selector: round robin or latency-aware), and a message whose producer id
was seen on the topic within the de-duplication window is not appended
again: its first copy's placement comes back marked duplicate (ActiveMQ's
message audit, Kafka's idempotent producer). The append runs outside the
engine's lock; how long it took is what the queue selector learns from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from broker.delivery.cursor import DELIVER_AT_HEADER
from broker.delivery.values import OutgoingMessage, Placement
from broker.errors import DeliveryError
from broker.store import AppendResult, Record

if TYPE_CHECKING:
    from broker.delivery.engine import Broker

_OUTGOING = attrgetter("body", "key", "tag", "headers", "message_id", "queue", "deliver_at")
_QUEUE = itemgetter(1)  # of a `Record`
_new_object, _set_attribute = object.__new__, object.__setattr__
_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C


def append(broker: Broker, topic: str, messages: Sequence[OutgoingMessage], *,
           dedup: bool = True) -> list[Placement]:
    """Append to any topic (internal ones included); with ``dedup``, ids seen within the
    window are dropped (the first copy's placement comes back, marked duplicate)."""
    if not messages:
        return []
    columns: list[Sequence[Any]] = list(zip(*map(_OUTGOING, messages)))
    if not all(map(isinstance, columns[0], repeat(bytes))):
        bad = next(body for body in columns[0] if not isinstance(body, bytes))
        raise DeliveryError(f"message body must be bytes, got {type(bad).__name__}")
    named = dedup and any(columns[4])
    placements: list[Placement | None] = [None] * len(messages)
    with broker.lock:
        fresh = _fresh(broker, topic, messages, placements) if named else range(len(messages))
        if len(fresh) < len(messages):
            columns = [list(map(column.__getitem__, fresh)) for column in columns]
        records = _records(broker, topic, columns) if fresh else []
    placed = _placements(topic, _timed_append(broker, topic, records) if records else [])
    with broker.lock:
        if named:
            for index, placement in zip(fresh, placed):
                if messages[index].message_id:  # an id the store made cannot be sent again
                    broker.dedup.add(placement)
        broker.lock.notify_all()
    if len(placed) == len(messages):
        return placed
    _run(map(placements.__setitem__, fresh, placed))
    first = {m.message_id: p for m, p in zip(messages, placements) if p is not None}  # in-batch copies
    return [p if p is not None else replace(first[m.message_id], duplicate=True)
            for m, p in zip(messages, placements)]


def _timed_append(broker: Broker, topic: str, records: list[Record]) -> list[AppendResult]:
    """The store's append, its latency told to the topic's queue selector for every queue it
    wrote to (with one store, a queue's latency is that of the appends it took part in); a
    failed append counts as the worst latency."""
    selector = broker.topic_table.selector
    if not selector.measures:
        return broker.store.append(records)
    queues = set(map(_QUEUE, records))
    started = broker.clock.time()
    try:
        results = broker.store.append(records)
    except BaseException:
        with broker.lock:
            selector.failed(topic, queues)
        raise
    with broker.lock:
        selector.appended(topic, queues, broker.clock.time() - started)
    return results


def _fresh(broker: Broker, topic: str, messages: Sequence[OutgoingMessage],
           placements: list[Placement | None]) -> list[int]:
    """Where in ``messages`` the ones to append are: not those whose id was seen within the
    window (their first placement, marked duplicate, goes into ``placements``) or earlier in
    the batch."""
    fresh: list[int] = []
    named: set[str] = set()
    for index, message in enumerate(messages):
        if message.message_id:
            seen = _seen(broker, topic, message.message_id)
            if seen is not None or message.message_id in named:
                placements[index] = replace(seen, duplicate=True) if seen else None
                continue
            named.add(message.message_id)
        fresh.append(index)
    return fresh


def _records(broker: Broker, topic: str, columns: Sequence[Sequence[Any]]) -> list[Record]:
    """The records of the messages whose ``columns`` (body, key, tag, headers, message id,
    queue asked for, deliver at) are given, each in the queue the topic table selects for it."""
    bodies, keys, tags, headers, message_ids, asked, due = columns
    queues = broker.topic_table.select_many(topic, keys, asked)
    if any(due):
        headers = tuple({**h, DELIVER_AT_HEADER: repr(at)} if at else h for h, at in zip(headers, due))
    return list(map(tuple.__new__, repeat(Record), zip(
        repeat(topic), queues, bodies, keys, tags, headers, message_ids, repeat(0))))


def _seen(broker: Broker, topic: str, message_id: str) -> Placement | None:
    """Where ``message_id`` went on ``topic`` if published within the window; the store's id
    index answers until the in-memory window has covered a whole window since start (for
    topics that had messages before the start: the others' ids are all in the window)."""
    found = broker.dedup.get(topic, message_id)
    window = broker.config.dedup_window
    if (found is None and broker.clock.time() - broker.started_at < window
            and topic in broker.stored_before_start):
        stored = broker.store.lookup_id(message_id)
        if (stored is not None and stored.topic == topic
                and broker.clock.time() - stored.store_time <= window):
            found = Placement(stored.topic, stored.queue, stored.queue_offset, message_id)
    return found


def _placements(topic: str, results: Sequence[AppendResult]) -> list[Placement]:
    """Where the appended records went, one `Placement` each, made as `values.many` makes
    them (a frozen dataclass's ``__init__`` costs more than the rest of a publish), each
    ``__dict__`` written out whole (test_publishing checks it has every field)."""
    made = list(map(_new_object, repeat(Placement, len(results))))
    _run(map(_set_attribute, made, repeat("__dict__"), [
        {"topic": topic, "queue": queue, "offset": offset, "message_id": message_id,
         "duplicate": False} for _, queue, offset, _, message_id, _ in results]))
    return made
