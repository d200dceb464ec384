"""What an operator asks of the engine: topics, groups, lag, and the dead-letter queues.

The listings are functions of the parts they read (the store, the topic
table, the offset book, the live groups), which `Broker` hands them under
its lock; `DeadLetters` owns the dead-letter queues ``%DLQ%<group>`` and
their purge marks, kept in the offset book under the pseudo-group
``%ADMIN%``. Neither reaches into the engine.

Letters replayed or purged one by one (`DeadLetters.settle`) may lie above
letters still waiting: their offsets are kept in ``dlq-settled.json`` until
the mark passes them, so a listing skips them and the count leaves them out.
A replay settles its letters 500 at a time, each taken (in memory) before it
is sent and settled only once sent, so no two operators send one letter and
a purge never has its mark moved back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from broker.delivery.group import ORIGIN_TOPIC, Group, dlq_topic, retry_topic
from broker.delivery.offsets import OffsetBook
from broker.delivery.values import Delivery, GroupInfo, OutgoingMessage, QueueLag, TopicInfo
from broker.errors import InvalidRequestError
from broker.store import MessageStore
from broker.store.files import atomic_write

ADMIN = "%ADMIN%"
BODY_SIZE = "x-dlq-body-size"
"""The header of a listed letter whose body was cut (``body_limit``): the whole body's bytes."""
LISTING_READ = 1024 * 1024
"""Bytes of records a listing with ``body_limit`` reads at once (or one record, if larger)."""


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
                 publish_to_group: Callable[[str, str, Sequence[OutgoingMessage]], Any],
                 settled: Path) -> None:
        self._store = store
        self._offsets = offsets
        self._lock = lock
        self._publish_to_group = publish_to_group
        self._settled_path = settled
        self._settled: dict[str, set[int]] = (
            {group: set(found) for group, found in json.loads(settled.read_text()).items()}
            if settled.exists() else {})
        self._taken: dict[str, set[int]] = {}  # being sent back now: a concurrent call skips them

    def _mark(self, group: str) -> int:
        saved = self._offsets.get((ADMIN, dlq_topic(group), 0))
        first = self._store.min_offset(dlq_topic(group), 0)
        return first if saved is None else max(saved, first)

    def list(self, group: str, limit: int, body_limit: int | None = None) -> list[Delivery]:
        """The dead letters of ``group`` neither purged nor replayed, oldest first (cause in
        ``x-dlq-cause``); ``offset`` names a letter for `settle`. With ``body_limit`` each body
        is cut to its first bytes (its whole size in `BODY_SIZE`) as it is read, and the store is
        read `LISTING_READ` bytes at a time: a listing holds one whole record at most."""
        letters: list[Delivery] = []
        with self._lock:
            at, end = self._mark(group), self._store.max_offset(dlq_topic(group), 0)
            settled = self._settled.get(group, set()) | self._taken.get(group, set())
            while len(letters) < limit and at < end:
                stored = self._store.read_batch(dlq_topic(group), 0, at, limit - len(letters) + len(settled),
                                                None if body_limit is None else LISTING_READ).messages()
                if not stored:
                    break
                letters += [_letter(m, body_limit) for m in stored if m.queue_offset not in settled]
                at = stored[-1].queue_offset + 1
        return letters[:limit]

    def waiting(self, group: str) -> int:
        """How many dead letters of ``group`` are neither purged nor replayed, nor being replayed."""
        with self._lock:
            mark = self._mark(group)
            busy = self._settled.get(group, set()) | self._taken.get(group, set())
            settled = sum(1 for offset in busy if offset >= mark)
            return max(0, self._store.max_offset(dlq_topic(group), 0) - mark - settled)

    def purge(self, group: str) -> int:
        purged = self.waiting(group)
        with self._lock:
            self._offsets.put((ADMIN, dlq_topic(group), 0), self._store.max_offset(dlq_topic(group), 0))
        self._save(group)
        return purged

    def replay(self, group: str) -> int:
        """Publish every dead letter back to ``group`` only (its original topic named), 500 at a
        time, each taken first (`settle`): replays, and purges, at once never send one twice."""
        replayed = 0
        while letters := self.list(group, 500):
            replayed += self.settle(group, [letter.offset for letter in letters], replay=True)
        return replayed

    def settle(self, group: str, offsets: Iterable[int], *, replay: bool) -> int:
        """Replay (to ``group`` only, as `replay` does) or purge the letters at ``offsets`` of
        ``%DLQ%<group>``, leaving the others waiting; how many were still waiting.

        The letters are taken first (a concurrent call skips them) and count as settled, and
        written down so, only once they were sent: a failed send leaves them waiting.
        """
        chosen = sorted(set(offsets))
        if any(offset < 0 for offset in chosen):
            raise InvalidRequestError(f"dead letters of {group!r}: offsets must be >= 0, got {chosen}")
        with self._lock:
            mark = self._mark(group)
            busy = self._settled.get(group, set()) | self._taken.get(group, set())
            letters = [m for offset in chosen if offset >= mark and offset not in busy
                       for m in self._store.read(dlq_topic(group), 0, offset, 1)[:1]
                       if m.queue_offset == offset]
            taken = {m.queue_offset for m in letters}
            self._taken.setdefault(group, set()).update(taken)
        try:
            if replay and letters:
                self._send_back(group, [_letter(m) for m in letters])
        except BaseException:
            self._release(group, taken, settled=False)
            raise
        self._release(group, taken, settled=True)
        self._save(group)
        return len(letters)

    def _release(self, group: str, taken: set[int], *, settled: bool) -> None:
        with self._lock:
            self._taken.get(group, set()).difference_update(taken)
            if settled:
                self._settled.setdefault(group, set()).update(taken)

    def _send_back(self, group: str, letters: Sequence[Delivery]) -> None:
        """Publish ``letters`` to ``group`` only, each to its original topic, without x-dlq-*."""
        by_topic: dict[str, list[OutgoingMessage]] = {}
        for letter in letters:
            topic = letter.headers.get(ORIGIN_TOPIC, letter.topic)
            headers = {k: v for k, v in letter.headers.items() if not k.startswith("x-dlq-")}
            by_topic.setdefault(topic, []).append(OutgoingMessage(letter.body, letter.key, letter.tag, headers,
                                                             message_id=letter.message_id))
        for topic, messages in by_topic.items():
            self._publish_to_group(group, topic, messages)

    def _save(self, group: str) -> None:
        """Move the mark past the settled letters right above it, forget those below it, and
        write both down (the offset book, then the settled offsets)."""
        with self._lock:
            key, mark = (ADMIN, dlq_topic(group), 0), self._mark(group)
            settled = self._settled.pop(group, set())
            while mark in settled:
                mark += 1
            if self._offsets.get(key) is not None or mark > self._store.min_offset(dlq_topic(group), 0):
                self._offsets.put(key, mark)
            if above := {offset for offset in settled if offset > mark}:
                self._settled[group] = above
            table = {name: sorted(found) for name, found in sorted(self._settled.items())}
        self._offsets.flush()
        if table or self._settled_path.exists():
            atomic_write(self._settled_path, json.dumps(table).encode())


def _letter(m: Any, body_limit: int | None = None) -> Delivery:
    body, headers = m.body, dict(m.headers)
    if body_limit is not None and len(body) > body_limit:
        body, headers[BODY_SIZE] = bytes(body[:body_limit]), str(len(body))
    return Delivery("", m.topic, m.queue, m.queue_offset, m.message_id, body, m.key, m.tag,
                    headers, m.attempt, m.store_time)
