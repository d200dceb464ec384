"""Reading records back: from consume-queue entries in few system calls, always CRC-checked.

Entries that lie close together in the log are read with one ``pread`` of at
most ``chunk`` bytes, so memory stays bounded by the batch whatever the log's
size. Every record is CRC-checked and compared with the entry that pointed at
it; a mismatch is a `CorruptRecordError` naming the file and offset, or, when
the store skips corrupt records, a logged gap. A wrong body is never returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import structlog

from broker.errors import CorruptRecordError, StoreError
from broker.store import codec
from broker.store.codec import FrameError
from broker.store.commitlog import CommitLog
from broker.store.consumequeue import QueueEntry
from broker.store.record import StoredMessage
from broker.store.segment import Segment

log = structlog.get_logger("broker.store")


def read_entries(
    commit_log: CommitLog,
    entries: Sequence[QueueEntry],
    place: tuple[str, int],
    visible: int,
    chunk: int,
    skip: bool,
) -> list[StoredMessage]:
    """The messages ``entries`` of queue ``place`` point at, up to the ``visible`` log offset."""
    messages: list[StoredMessage] = []
    i = 0
    while i < len(entries) and entries[i].log_offset + entries[i].size <= visible:
        first = entries[i]
        if first.log_offset < commit_log.min_offset:
            i += 1  # deleted by retention
            continue
        segment = commit_log.locate(first.log_offset)
        j, run_end = i + 1, first.log_offset + first.size
        while j < len(entries):
            end = entries[j].log_offset + entries[j].size
            if (entries[j].log_offset < run_end or end > visible or end > segment.end
                    or end - first.log_offset > chunk):
                break
            run_end, j = end, j + 1
        try:
            data = segment.read(first.log_offset - segment.base, run_end - first.log_offset)
        except StoreError:
            i = j  # the segment was deleted under us by retention
            continue
        for entry in entries[i:j]:
            message = _decode(data, entry.log_offset - first.log_offset, entry, segment, skip)
            if message is not None and (message.topic, message.queue) != place:
                _reject(segment, entry, "record belongs to another queue", skip)
                message = None
            if message is not None:
                messages.append(message)
        i = j
    return messages


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
    if not commit_log.min_offset <= log_offset < visible:
        return None
    try:
        segment = commit_log.locate(log_offset)
        head = segment.read(log_offset - segment.base, codec.FRAME_MIN)
    except StoreError:
        return None
    if len(head) < codec.FRAME_MIN or head[:2] != codec.MAGIC_BYTES:
        return None
    size = codec.PREFIX.size + codec.HEADER.unpack_from(head, codec.PREFIX.size)[0]
    if log_offset + size > segment.end:
        return None
    return read_at(commit_log, log_offset, size, visible)


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
