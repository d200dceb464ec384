"""Reading records back: from consume-queue entries in few system calls, always CRC-checked.

Entries that lie close together in the log are read with one ``pread`` of at
most ``chunk`` bytes, so memory stays bounded by the batch whatever the log's
size, and each such run is decoded column-wise (`columns`). Every record is
CRC-checked and compared with the entry that pointed at it; a mismatch is a
`CorruptRecordError` naming the file and offset, or, when the store skips
corrupt records, a logged gap. A wrong body is never returned.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, islice, repeat
from operator import add, le, sub
from typing import Any

import structlog

from broker.errors import CorruptRecordError, StoreError
from broker.store import codec
from broker.store.codec import FrameError
from broker.store.columns import decode_run
from broker.store.commitlog import CommitLog
from broker.store.consumequeue import QueueEntry
from broker.store.recent import RecentRecords
from broker.store.record import StoredBatch, StoredMessage
from broker.store.segment import Segment

log = structlog.get_logger("broker.store")


def read_span(
    commit_log: CommitLog,
    place: tuple[str, int],
    first: int,
    log_offsets: list[int],
    sizes: list[int],
    visible: int,
    chunk: int,
    skip: bool,
    recent: RecentRecords | None = None,
) -> StoredBatch:
    """The messages of queue ``place`` from queue offset ``first`` whose consume-queue entries are
    ``log_offsets`` and ``sizes``, up to the ``visible`` log offset: from ``recent`` if it
    holds them all, else read from the log."""
    topic, queue = place
    if (recent is not None and log_offsets and log_offsets[0] >= commit_log.min_offset
            and log_offsets == sorted(log_offsets)):  # in log order, unless the queue is damaged
        shown = bisect_left(log_offsets, visible)
        if shown and log_offsets[shown - 1] + sizes[shown - 1] > visible:
            shown -= 1  # visible ends a record: never so, unless the queue is damaged
        held = recent.take(log_offsets[:shown], sizes[:shown]) if shown else None
        if held is not None:
            return StoredBatch(topic, queue, range(first, first + shown), log_offsets[:shown], *held)
    ends = list(map(add, log_offsets, sizes))
    in_order = all(map(le, ends, islice(log_offsets, 1, None)))  # always, unless the queue is damaged
    topic_b = topic.encode()
    pieces: list[Sequence[Sequence[Any]]] = []  # the columns of each run read
    i, count = 0, len(log_offsets)
    while i < count and ends[i] <= visible:
        start = log_offsets[i]
        if start < commit_log.min_offset:
            i += 1  # deleted by retention
            continue
        segment = commit_log.locate(start)
        j = max(i + 1, bisect_right(ends, min(visible, segment.end, start + chunk), i)) if in_order else i + 1
        try:
            data = segment.read(start - segment.base, ends[j - 1] - start)
        except StoreError:
            i = j  # the segment was deleted under us by retention
            continue
        positions = list(map(sub, log_offsets[i:j], repeat(start)))
        run = decode_run(data, positions, sizes[i:j], first + i, topic_b, queue)
        pieces.append((range(first + i, first + j), log_offsets[i:j], *run) if run is not None
                      else _one_by_one(data, positions, first + i, log_offsets[i:j], sizes[i:j], place,
                                       segment, skip))
        i = j
    if len(pieces) == 1:
        return StoredBatch(topic, queue, *pieces[0])
    return StoredBatch(topic, queue, *(list(chain.from_iterable(column)) for column in zip(
        *pieces or [[()] * (len(StoredBatch._fields) - 2)])))


def _one_by_one(data: bytes, positions: list[int], first: int, log_offsets: list[int],
                sizes: list[int], place: tuple[str, int], segment: Segment,
                skip: bool) -> Sequence[Sequence[Any]]:
    """A run that failed the column-wise checks, decoded record by record: a bad one is named
    (`CorruptRecordError`) or, when skipping, logged and left out."""
    messages = []
    for number, (position, log_offset, size) in enumerate(zip(positions, log_offsets, sizes)):
        entry = QueueEntry(first + number, log_offset, size, 0)
        message = _decode(data, position, entry, segment, skip)
        if message is not None and (message.topic, message.queue) != place:
            _reject(segment, entry, "record belongs to another queue", skip)
            message = None
        if message is not None:
            messages.append(message)
    if not messages:
        return [()] * (len(StoredBatch._fields) - 2)
    return list(zip(*messages))[2:]


def lookup(
    commit_log: CommitLog,
    candidates: Iterable[tuple[int, int, int]],
    visible: int,
    max_count: int,
    matches: Callable[[StoredMessage], bool],
) -> list[StoredMessage]:
    """Up to ``max_count`` intact records among index ``candidates`` that ``matches`` accepts."""
    seen: set[int] = set()
    found: list[StoredMessage] = []
    for log_offset, size, _ in candidates:
        if len(found) >= max_count:
            break
        if log_offset in seen:
            continue
        seen.add(log_offset)
        message = read_at(commit_log, log_offset, size, visible)
        if message is not None and matches(message):
            found.append(message)
    return found


def read_at(commit_log: CommitLog, log_offset: int, size: int, visible: int) -> StoredMessage | None:
    """The record at ``log_offset`` if it is there, intact and visible; None otherwise (logged)."""
    if log_offset < commit_log.min_offset or log_offset + size > visible:
        return None
    try:
        segment = commit_log.locate(log_offset)
        data = segment.read(log_offset - segment.base, size)
    except StoreError:
        return None
    entry = QueueEntry(-1, log_offset, size, 0)
    return _decode(data, 0, entry, segment, skip=True)


def read_frame_at(commit_log: CommitLog, log_offset: int, visible: int) -> StoredMessage | None:
    """The record starting at ``log_offset`` when its size is not known (None if none there)."""
    size = _frame_size(commit_log, log_offset, visible)
    return read_at(commit_log, log_offset, size, visible) if size else None


def read_on(commit_log: CommitLog, log_offset: int, visible: int) -> Iterator[StoredMessage]:
    """The records from the one at ``log_offset`` on, one after another in the log, until one
    is missing or damaged (a reader walking a batch run stops when its ids stop following)."""
    while size := _frame_size(commit_log, log_offset, visible):
        message = read_at(commit_log, log_offset, size, visible)
        if message is None:
            return
        yield message
        log_offset += size


def _frame_size(commit_log: CommitLog, log_offset: int, visible: int) -> int:
    """The framed size of the record starting at ``log_offset`` (0 if none starts there)."""
    if not commit_log.min_offset <= log_offset < visible:
        return 0
    try:
        segment = commit_log.locate(log_offset)
        head = segment.read(log_offset - segment.base, codec.FRAME_MIN)
    except StoreError:
        return 0
    if len(head) < codec.FRAME_MIN or head[:2] != codec.MAGIC_BYTES:
        return 0
    size = codec.PREFIX.size + codec.HEADER.unpack_from(head, codec.PREFIX.size)[0]
    return size if log_offset + size <= segment.end else 0


def _decode(data: bytes, pos: int, entry: QueueEntry, segment: Segment, skip: bool) -> StoredMessage | None:
    try:
        fields = codec.check(data, pos, entry.size)
        if fields is None or codec.PREFIX.size + fields[0] != entry.size:
            raise FrameError("record size differs from its index entry")
        if entry.queue_offset >= 0 and fields[3] != entry.queue_offset:
            raise FrameError("record queue offset differs from its consume-queue entry")
        return codec.decode(data, pos, fields, entry.log_offset)
    except FrameError as exc:
        _reject(segment, entry, str(exc), skip)
        return None


def _reject(segment: Segment, entry: QueueEntry, reason: str, skip: bool) -> None:
    position = entry.log_offset - segment.base
    if not skip:
        raise CorruptRecordError(str(segment.path), position, reason)
    log.error("store.record_skipped", file=str(segment.path), position=position, reason=reason)
