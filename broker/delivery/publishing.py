"""The publishing half of `Broker`: records into the store, de-duplicated by message id.

A publish becomes one append to the store: each message gets the queue the
topic table selects for it (asked for, by key hash, else the topic's queue
selector: round robin or latency-aware), and a message whose producer id
was seen on the topic within the de-duplication window is not appended
again: its first copy's placement comes back marked duplicate (ActiveMQ's
message audit, Kafka's idempotent producer). The append runs outside the
publishing lock; how long it took is what the queue selector learns from.

A publish from a client that names its batch with one batch id instead of an id
per message (`batches`: the spans of a publish, each a batch id and a count)
gets the ids ``<batch id>.0 ...`` (`broker.store.runs`), and is de-duplicated as
a whole: one window entry per batch, and one id-index entry per batch run in
the store (Kafka's producer sequence). A resend with the same batch id gets the
first copy's placements back, marked duplicate; after a restart the store's
runs answer, and a batch a torn write cut short gets only its lost tail
appended.

`Publishing` owns the topic table (and its queue selector) and the window,
under a lock of its own that no other component takes; it never holds it
across an append, nor while it tells the consuming side (``arrived``) that
messages came. A publish is three steps: `Publishing.begin` (under that lock:
ids looked up, queues chosen, the records built column by column), the store's
append, and `Publishing.finish` (ids remembered, waiting members woken,
placements). `Publishing.append_columns` runs them on the caller's thread; the
server runs the first and the last on its event loop without waiting
(`try_begin`, `try_finish`) and awaits the append in between.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress, repeat, starmap
from typing import Any

from broker.delivery.config import DeliveryConfig
from broker.delivery.cursor import DELIVER_AT_HEADER
from broker.delivery.dedup import DedupWindow
from broker.delivery.selection import QueueSelector
from broker.delivery.topics import Topics
from broker.delivery.values import (
    MessageColumns,
    OutgoingMessage,
    Placement,
    PlacementColumns,
)
from broker.errors import DeliveryError
from broker.store import Appended, Clock, MessageStore, RecordColumns
from broker.store.runs import run_ids

_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C


Batch = tuple[str, int]  # a producer's batch id and how many messages (one after another) it names


@dataclass(frozen=True)
class Publish:
    """A publish checked and placed in queues, not yet appended (see `begin`)."""

    topic: str
    message_ids: Sequence[str]
    named: bool  # ids to look for and remember one by one
    fresh: Sequence[int]  # the messages to append (the others are copies)
    copies: dict[int, Placement | None]
    records: RecordColumns | None  # None: nothing to append
    batches: Sequence[Batch] = ()  # the batch ids that name the messages, to remember


class Publishing:
    """Topics, the de-duplication window and the appends: the engine's publishing component.

    Its lock guards the topic table (with its queue selector) and the window only, never
    held across an append; ``arrived`` is told after every publish (members waiting to fetch
    wake up). Other components ask it for a topic's queue count (`queues`, `known`).
    """

    def __init__(self, store: MessageStore, topic_table: Topics, dedup: DedupWindow, clock: Clock,
                 config: DeliveryConfig, arrived: Callable[[], None]) -> None:
        self._store = store
        self._topics = topic_table
        self._dedup = dedup
        self._clock = clock
        self._config = config
        self._arrived = arrived
        self._lock = threading.Lock()
        self._started_at = clock.monotonic()
        self._stored_before_start = {topic for topic, _ in store.queues()}  # what the id index may know

    def queues(self, topic: str) -> int:
        """The queue count of ``topic``, creating it (see `Topics.queues`)."""
        with self._lock:
            return self._topics.queues(topic)

    @property
    def selector(self) -> QueueSelector:
        """How a message without a key or a queue asked for is given a queue."""
        return self._topics.selector

    def has_topic(self, topic: str) -> bool:
        """Whether ``topic`` exists (one read: no lock)."""
        return self._topics.exists(topic)

    def held_queues(self, topic: str) -> int:
        """The queue count of ``topic``, 0 if it does not exist (one read: no lock; nothing made)."""
        return self._topics.held(topic)

    def known(self) -> dict[str, int]:
        with self._lock:
            return self._topics.known()

    def try_begin(self, topic: str, messages: MessageColumns,
                  batches: Sequence[Batch] = ()) -> Publish | None:
        """`begin` without waiting, for a caller that may not block (the server's event loop):
        None when the lock is busy, or when the publish has to run on a thread (a queue selector
        times its append, or an id has to be looked for on disk)."""
        if self._topics.selector.measures or not self.window_covers(topic):
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self.begin(topic, messages, batches=batches)
        finally:
            self._lock.release()

    async def append_async(self, publish: Publish) -> Appended | None:
        """The store's append of ``publish`` awaited on the event loop (see `try_begin`)."""
        return await self._store.append_columns_async(publish.records) if publish.records else None

    def try_finish(self, publish: Publish, appended: Appended | None) -> PlacementColumns | None:
        """`finish` without waiting: None when the lock is busy."""
        placed = _placed(publish, appended)
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._remember(publish, appended, placed)
        finally:
            self._lock.release()
        self._arrived()
        return placed

    def append(self, topic: str, messages: Sequence[OutgoingMessage], *,
               dedup: bool = True) -> list[Placement]:
        """`append_columns` for messages one by one, their placements one by one."""
        return self.append_columns(topic, MessageColumns.of(messages), dedup=dedup).placements()

    def append_columns(self, topic: str, messages: MessageColumns, *,
                       dedup: bool = True, batches: Sequence[Batch] = ()) -> PlacementColumns:
        """Append to any topic (internal ones included); with ``dedup``, ids seen within the
        window are dropped (the first copy's placement comes back, marked duplicate). With
        ``batches``, the messages are batches named by batch ids (see the module's docstring)."""
        with self._lock:
            publish = self.begin(topic, messages, dedup=dedup, batches=batches)
        appended = self._timed_append(topic, publish.records) if publish.records else None
        return self.finish(publish, appended)

    def begin(self, topic: str, messages: MessageColumns, *, dedup: bool = True,
              batches: Sequence[Batch] = ()) -> Publish:
        """The records of a publish: its messages but for the copies of ids seen (the caller holds
        the publishing lock); the append of ``records`` and `finish` complete it."""
        if not messages.count:
            return Publish(topic, (), False, (), {}, None)
        bodies, message_ids = messages.column("body"), messages.column("message_id")
        if not all(map(isinstance, bodies, repeat(bytes))):
            bad = next(body for body in bodies if not isinstance(body, bytes))
            raise DeliveryError(f"message body must be bytes, got {type(bad).__name__}")
        if batches:
            return self._begin_batches(topic, messages, batches)
        named = dedup and any(message_ids)
        fresh, copies = self._fresh(topic, message_ids) if named else (range(messages.count), {})
        records = self._records(topic, messages if not copies else messages.taken(fresh))
        return Publish(topic, message_ids, named, fresh, copies, records)

    def _begin_batches(self, topic: str, messages: MessageColumns,
                       batches: Sequence[Batch]) -> Publish:
        """`begin` for messages named by batch ids: ids made from the batch ids, and the batches seen
        within the window (or, in the first window after a restart, held by the store) not
        appended again."""
        if sum(count for _, count in batches) != messages.count or any(messages.column("message_id")):
            raise DeliveryError("batches must name every message of a publish, and only messages "
                                "without an id")
        message_ids = list(chain.from_iterable(starmap(run_ids, batches)))
        copies = self._batch_copies(topic, batches, message_ids)
        fresh = range(messages.count) if not copies else [i for i in range(messages.count) if i not in copies]
        starts = set(accumulate((count for _, count in batches[:-1]), initial=0))
        continues = ([index - 1 not in copies and index not in starts for index in fresh] if copies
                     else list(chain.from_iterable([False] + [True] * (count - 1) for _, count in batches)))
        with_ids = messages.with_column("message_id", message_ids)
        records = self._records(topic, with_ids if not copies else with_ids.taken(fresh))
        records = records._replace(continues=continues) if records else None
        return Publish(topic, message_ids, False, fresh, copies, records, batches)

    def _batch_copies(self, topic: str, batches: Sequence[Batch],
                      message_ids: Sequence[str]) -> dict[int, Placement | None]:
        """The messages of ``batches`` already published: each placed where its first copy went (None:
        a batch id twice in this publish, placed where its first span goes)."""
        copies: dict[int, Placement | None] = {}
        in_store = not self.window_covers(topic)
        seen: set[str] = set()
        start = 0
        for batch_id, count in batches:
            if batch_id in seen:
                copies.update(zip(range(start, start + count), repeat(None)))
            elif (found := self._dedup.find_batch(topic, batch_id, count)) is not None:
                places = zip(repeat(topic), *found, message_ids[start : start + count])
                copies.update(zip(range(start, start + count), starmap(Placement, places)))
            elif in_store:
                stored = self._store.lookup_run(batch_id, count)
                horizon = self._clock.time() - self._config.dedup_window
                copies.update((start + position, Placement(topic, m.queue, m.queue_offset, m.message_id))
                              for position, m in enumerate(stored)
                              if m is not None and m.topic == topic and m.store_time >= horizon)
            seen.add(batch_id)
            start += count
        return copies

    def finish(self, publish: Publish, appended: Appended | None) -> PlacementColumns:
        """Remember the ids just appended, wake the members waiting, say where everything went."""
        placed = _placed(publish, appended)
        with self._lock:
            self._remember(publish, appended, placed)
        self._arrived()
        return placed

    def _remember(self, publish: Publish, appended: Appended | None, placed: PlacementColumns) -> None:
        """Put the ids of ``publish`` in the window (the lock held)."""
        if publish.batches:
            self._remember_batches(publish, placed)
        elif publish.named and appended is not None:
            topic, message_ids = publish.topic, publish.message_ids
            queues, offsets, stored_ids = appended.queues, appended.queue_offsets, appended.message_ids
            if len(offsets) == len(message_ids) and all(message_ids):  # the usual batch: all appended, all named
                self._dedup.add(topic, queues, offsets, stored_ids)
            else:
                self._dedup.add(topic, *_named(queues, offsets, stored_ids,
                                                list(map(message_ids.__getitem__, publish.fresh))))

    def _remember_batches(self, publish: Publish, placed: PlacementColumns) -> None:
        """Put each batch of ``publish`` in the window with the places of all its messages."""
        queues, offsets = placed.column("queue"), placed.column("offset")
        start = 0
        for batch_id, count in publish.batches:
            self._dedup.add_batch(publish.topic, batch_id, queues[start : start + count],
                                   offsets[start : start + count])
            start += count

    def _timed_append(self, topic: str, records: RecordColumns) -> Appended:
        """The store's append, its latency told to the topic's queue selector for every queue it
        wrote to (with one store, a queue's latency is that of the appends it took part in); a
        failed append counts as the worst latency."""
        selector = self._topics.selector
        if not selector.measures:
            return self._store.append_columns(records)
        queues = set(records.queues)
        started = self._clock.monotonic()
        try:
            appended = self._store.append_columns(records)
        except BaseException:
            with self._lock:
                selector.failed(topic, queues)
            raise
        with self._lock:
            selector.appended(topic, queues, self._clock.monotonic() - started)
        return appended

    def window_covers(self, topic: str) -> bool:
        """Whether the in-memory window knows every id to look for on ``topic``: not so, for a topic
        that had messages before the start, until a whole window has passed (the store's id index
        answers meanwhile, a read of the disk per id)."""
        return (topic not in self._stored_before_start
                or self._clock.monotonic() - self._started_at >= self._config.dedup_window)

    def _fresh(self, topic: str,
               message_ids: Sequence[str]) -> tuple[Sequence[int], dict[int, Placement | None]]:
        """Where the messages to append are: not those whose id was seen within the window nor
        earlier in the batch (the copies: the window's placement of each, None if in the batch)."""
        found = self._dedup.find(topic, message_ids)
        in_store = not self.window_covers(topic)
        if not in_store and found.count(None) == len(found) and len(set(message_ids)) == len(found):
            return range(len(found)), {}  # the usual batch: new ids, each once
        fresh: list[int] = []
        copies: dict[int, Placement | None] = {}
        named: set[str] = set()
        for index, message_id in enumerate(message_ids):
            if message_id:
                seen = found[index] or (self._stored(topic, message_id) if in_store else None)
                if seen is not None or message_id in named:
                    copies[index] = seen
                    continue
                named.add(message_id)
            fresh.append(index)
        return fresh, copies

    def _records(self, topic: str, messages: MessageColumns) -> RecordColumns | None:
        """The records of ``messages``, each in the queue the topic table selects for it."""
        count = messages.count
        if not count:
            return None
        keys, headers, due = messages.column("key"), messages.column("headers"), messages.column("deliver_at")
        queues = self._topics.select_many(topic, keys, messages.column("queue"))
        if any(due):
            headers = [{**h, DELIVER_AT_HEADER: repr(at)} if at else h for h, at in zip(headers, due)]
        return RecordColumns([topic] * count, queues, messages.column("body"), keys, messages.column("tag"),
                             headers, messages.column("message_id"), [0] * count)

    def _stored(self, topic: str, message_id: str) -> Placement | None:
        """Where ``message_id`` went on ``topic`` within the window, by the store's id index (which
        answers until the in-memory window has covered a whole window since start, for topics that
        had messages before the start: the others' ids are all in the window)."""
        stored = self._store.lookup_id(message_id)
        if (stored is not None and stored.topic == topic
                and self._clock.time() - stored.store_time <= self._config.dedup_window):
            return Placement(stored.topic, stored.queue, stored.queue_offset, message_id)
        return None


def _placed(publish: Publish, appended: Appended | None) -> PlacementColumns:
    """Where every message of ``publish`` went: its own place, or its first copy's."""
    topic, message_ids, count = publish.topic, publish.message_ids, len(publish.message_ids)
    queues, offsets, stored_ids = ((appended.queues, appended.queue_offsets, appended.message_ids)
                                   if appended else ((), (), ()))
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

