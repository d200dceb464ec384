"""Walking the commit log frame by frame, in bounded memory, and judging damage.

A bad frame followed by nothing valid is a torn tail (a crash mid-write, a
zero-filled or junk tail). A bad frame followed by a valid one is damage in the
middle of the log: recovery treats that as a hard error unless told to skip.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import NamedTuple

from broker.store import codec
from broker.store.codec import FrameError
from broker.store.commitlog import CommitLog
from broker.store.segment import Segment

OnDamage = Callable[[Segment, int, str], "int | None"]
"""Told (segment, position, reason) of a bad frame; returns the log offset to resume at, or None."""


class Damage(NamedTuple):
    """A bad frame at ``position`` of a segment."""

    position: int
    reason: str


Frame = tuple[int, bytes, int, tuple[int, ...]]
"""(log offset, buffer, position of the frame in the buffer, its validated header fields)."""


def frames(
    log: CommitLog, start: int, max_size: int, chunk: int, on_damage: OnDamage
) -> Iterator[Frame]:
    """Yield every valid frame from ``start`` on, reading about ``chunk`` bytes at a time."""
    offset: int | None = start
    while offset is not None and offset < log.end:
        segment = log.locate(offset)
        stop = yield from _segment_frames(segment, offset - segment.base, max_size, chunk)
        offset = on_damage(segment, *stop) if isinstance(stop, Damage) else stop


def _segment_frames(
    segment: Segment, position: int, max_size: int, chunk: int
) -> Generator[Frame, None, int | Damage]:
    """Frames of one segment from ``position``; returns the next log offset or the damage."""
    data = b""
    data_at = position
    while position < segment.size:
        index = position - data_at
        try:
            fields = codec.check(data, index, max_size)
        except FrameError as exc:
            return Damage(position, str(exc))
        if fields is None:
            if data_at + len(data) >= segment.size:
                return Damage(position, "frame runs past the end of the segment")
            need = max(chunk, codec.FRAME_MIN, _frame_size(data, index))
            data = data[index:] + segment.read(data_at + len(data), need)
            data_at = position
            continue
        yield segment.base + position, data, index, fields
        position += codec.PREFIX.size + fields[0]
    return segment.end


def _frame_size(data: bytes, index: int) -> int:
    if len(data) - index >= codec.FRAME_MIN:
        return codec.PREFIX.size + codec.HEADER.unpack_from(data, index + codec.PREFIX.size)[0]
    return 0


def next_valid(log: CommitLog, segment: Segment, position: int, max_size: int, chunk: int) -> int | None:
    """The log offset of the first valid frame after a bad one at ``position``, if any."""
    found = _search(segment, position + 1, max_size, chunk)
    if found is not None:
        return segment.base + found
    for later in log.segments:
        if later.base > segment.base and later.size:
            try:
                if codec.check(later.read(0, max_size), 0, max_size) is not None:
                    return later.base
            except FrameError:
                found = _search(later, 1, max_size, chunk)
                if found is not None:
                    return later.base + found
    return None


def _search(segment: Segment, position: int, max_size: int, chunk: int) -> int | None:
    """The first position at or after ``position`` in ``segment`` holding a valid frame."""
    while position < segment.size:
        data = segment.read(position, chunk + max_size)
        index = data.find(codec.MAGIC_BYTES)
        while 0 <= index < min(chunk, len(data)):
            try:
                if codec.check(data, index, max_size) is not None:
                    return position + index
            except FrameError:
                pass
            index = data.find(codec.MAGIC_BYTES, index + 1)
        position += chunk
    return None
