"""The publishing half of `Broker`: records into the store, de-duplicated by message id.

A publish becomes one append to the store: each message gets the queue the
topic table selects for it (asked for, by key hash, else the topic's queue
selector: round robin or latency-aware), and a message whose producer id
was seen on the topic within the de-duplication window is not appended
again: its first copy's placement comes back marked duplicate (ActiveMQ's
message audit, Kafka's idempotent producer). The append runs outside the
engine's lock; how long it took is what the queue selector learns from.

A publish is three steps: `begin` (under the engine's lock: ids looked up,
queues chosen, the records built column by column), the store's append, and
`finish` (ids remembered, waiting members woken, placements). `append_columns`
runs them on the caller's thread; the server runs the first and the last on
its event loop and awaits the append in between.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any

from broker.delivery.cursor import DELIVER_AT_HEADER
from broker.delivery.values import (
    MessageColumns,
    OutgoingMessage,
    Placement,
    PlacementColumns,
)
from broker.errors import DeliveryError
from broker.store import Appended, RecordColumns

if TYPE_CHECKING:
    from broker.delivery.engine import Broker

_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C


def append(broker: Broker, topic: str, messages: Sequence[OutgoingMessage], *,
           dedup: bool = True) -> list[Placement]:
    """`append_columns` for messages one by one, their placements one by one."""
    return append_columns(broker, topic, MessageColumns.of(messages), dedup=dedup).placements()


def append_columns(broker: Broker, topic: str, messages: MessageColumns, *,
                   dedup: bool = True) -> PlacementColumns:
    """Append to any topic (internal ones included); with ``dedup``, ids seen within the
    window are dropped (the first copy's placement comes back, marked duplicate)."""
    with broker.lock:
        publish = begin(broker, topic, messages, dedup=dedup)
    appended = _timed_append(broker, topic, publish.records) if publish.records else None
    return finish(broker, publish, appended)


@dataclass(frozen=True)
class Publish:
    """A publish checked and placed in queues, not yet appended (see `begin`)."""

    topic: str
    message_ids: Sequence[str]
    named: bool  # ids to look for and remember
    fresh: Sequence[int]  # the messages to append (the others are copies)
    copies: dict[int, Placement | None]
    records: RecordColumns | None  # None: nothing to append


def begin(broker: Broker, topic: str, messages: MessageColumns, *, dedup: bool = True) -> Publish:
    """The records of a publish: its messages but for the copies of ids seen (the caller holds
    the engine's lock); the append of ``records`` and `finish` complete it."""
    if not messages.count:
        return Publish(topic, (), False, (), {}, None)
    bodies, message_ids = messages.column("body"), messages.column("message_id")
    if not all(map(isinstance, bodies, repeat(bytes))):
        bad = next(body for body in bodies if not isinstance(body, bytes))
        raise DeliveryError(f"message body must be bytes, got {type(bad).__name__}")
    named = dedup and any(message_ids)
    fresh, copies = _fresh(broker, topic, message_ids) if named else (range(messages.count), {})
    records = _records(broker, topic, messages if not copies else messages.taken(fresh))
    return Publish(topic, message_ids, named, fresh, copies, records)


def finish(broker: Broker, publish: Publish, appended: Appended | None) -> PlacementColumns:
    """Remember the ids just appended, wake the members waiting, say where everything went."""
    topic, message_ids, count = publish.topic, publish.message_ids, len(publish.message_ids)
    queues, offsets, stored_ids = ((appended.queues, appended.queue_offsets, appended.message_ids)
                                   if appended else ((), (), ()))
    with broker.lock:
        if publish.named:
            if len(offsets) == count and all(message_ids):  # the usual batch: all appended, all named
                broker.dedup.add(topic, queues, offsets, stored_ids)
            else:
                broker.dedup.add(topic, *_named(queues, offsets, stored_ids,
                                                list(map(message_ids.__getitem__, publish.fresh))))
        broker.lock.notify_all()
    if not count:
        return PlacementColumns(0, {}, {})
    if not publish.copies:
        return PlacementColumns(count, {"topic": topic, "duplicate": False},
                                {"queue": queues, "offset": offsets, "message_id": stored_ids})
    return _with_copies(topic, message_ids, publish.fresh, (queues, offsets, stored_ids), publish.copies)


def _named(queues: Sequence[int], offsets: Sequence[int], stored_ids: Sequence[str],
           given: list[str]) -> tuple[list[int], list[int], list[str]]:
    """The places of the messages appended whose producer gave an id (``given`` non-empty)."""
    return (list(compress(queues, given)), list(compress(offsets, given)),
            list(compress(stored_ids, given)))


def _with_copies(topic: str, message_ids: Sequence[str], fresh: Sequence[int],
                 appended: tuple[Sequence[int], Sequence[int], Sequence[str]],
                 copies: dict[int, Placement | None]) -> PlacementColumns:
    """The placements of a batch some of whose messages were not appended: those of
    ``fresh`` (at the places ``appended``), and each of ``copies`` marked duplicate at its
    first copy's place (that of the window, else that of its first copy in the batch)."""
    count = len(message_ids)
    places: list[tuple[int, int, str]] = [(0, 0, "")] * count
    _run(map(places.__setitem__, fresh, zip(*appended)))
    first = {message_ids[index]: places[index] for index in fresh}
    for index, seen in copies.items():
        places[index] = (seen.queue, seen.offset, seen.message_id) if seen else first[message_ids[index]]
    queues, offsets, stored_ids = map(list, zip(*places))
    duplicates = [True] * count
    _run(map(duplicates.__setitem__, fresh, repeat(False)))
    return PlacementColumns(count, {"topic": topic}, {"queue": queues, "offset": offsets,
                                                      "message_id": stored_ids, "duplicate": duplicates})


def _timed_append(broker: Broker, topic: str, records: RecordColumns) -> Appended:
    """The store's append, its latency told to the topic's queue selector for every queue it
    wrote to (with one store, a queue's latency is that of the appends it took part in); a
    failed append counts as the worst latency."""
    selector = broker.topic_table.selector
    if not selector.measures:
        return broker.store.append_columns(records)
    queues = set(records.queues)
    started = broker.clock.time()
    try:
        appended = broker.store.append_columns(records)
    except BaseException:
        with broker.lock:
            selector.failed(topic, queues)
        raise
    with broker.lock:
        selector.appended(topic, queues, broker.clock.time() - started)
    return appended


def window_covers(broker: Broker, topic: str) -> bool:
    """Whether the in-memory window knows every id to look for on ``topic``: not so, for a topic
    that had messages before the start, until a whole window has passed (the store's id index
    answers meanwhile, a read of the disk per id)."""
    return (topic not in broker.stored_before_start
            or broker.clock.time() - broker.started_at >= broker.config.dedup_window)


def _fresh(broker: Broker, topic: str,
           message_ids: Sequence[str]) -> tuple[Sequence[int], dict[int, Placement | None]]:
    """Where the messages to append are: not those whose id was seen within the window nor
    earlier in the batch (the copies: the window's placement of each, None if in the batch)."""
    found = broker.dedup.find(topic, message_ids)
    in_store = not window_covers(broker, topic)
    if not in_store and found.count(None) == len(found) and len(set(message_ids)) == len(found):
        return range(len(found)), {}  # the usual batch: new ids, each once
    fresh: list[int] = []
    copies: dict[int, Placement | None] = {}
    named: set[str] = set()
    for index, message_id in enumerate(message_ids):
        if message_id:
            seen = found[index] or (_stored(broker, topic, message_id) if in_store else None)
            if seen is not None or message_id in named:
                copies[index] = seen
                continue
            named.add(message_id)
        fresh.append(index)
    return fresh, copies


def _records(broker: Broker, topic: str, messages: MessageColumns) -> RecordColumns | None:
    """The records of ``messages``, each in the queue the topic table selects for it."""
    count = messages.count
    if not count:
        return None
    keys, headers, due = messages.column("key"), messages.column("headers"), messages.column("deliver_at")
    queues = broker.topic_table.select_many(topic, keys, messages.column("queue"))
    if any(due):
        headers = [{**h, DELIVER_AT_HEADER: repr(at)} if at else h for h, at in zip(headers, due)]
    return RecordColumns([topic] * count, queues, messages.column("body"), keys, messages.column("tag"),
                         headers, messages.column("message_id"), [0] * count)


def _stored(broker: Broker, topic: str, message_id: str) -> Placement | None:
    """Where ``message_id`` went on ``topic`` within the window, by the store's id index (which
    answers until the in-memory window has covered a whole window since start, for topics that
    had messages before the start: the others' ids are all in the window)."""
    stored = broker.store.lookup_id(message_id)
    if (stored is not None and stored.topic == topic
            and broker.clock.time() - stored.store_time <= broker.config.dedup_window):
        return Placement(stored.topic, stored.queue, stored.queue_offset, message_id)
    return None
