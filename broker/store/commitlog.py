"""`CommitLog`: the one append-only log all topics share, as a list of segments.

A log offset is a byte position in the whole log: a segment named N holds
offsets N .. N+size. A new segment starts where the previous one ends, so
offsets are contiguous, and a record is never split across two segments.
Writers are serialised by the store's lock; readers use a snapshot of the
segment list, which is replaced, never mutated.
"""

from __future__ import annotations

import bisect
from pathlib import Path

from broker.errors import CorruptStoreError, StoreError
from broker.store.files import NAME_DIGITS, fsync_directory, named_offset
from broker.store.segment import SUFFIX, Segment, segment_name


class CommitLog:
    """The segments of one store directory, oldest first; the last one takes appends."""

    def __init__(self, directory: Path, segment_size: int, fsync_on_roll: bool) -> None:
        self.directory = directory
        self.segment_size = segment_size
        self.fsync_on_roll = fsync_on_roll
        directory.mkdir(parents=True, exist_ok=True)
        self.segments: list[Segment] = [
            Segment(path, _base(path)) for path in sorted(directory.glob("*" + SUFFIX))
        ]
        if not self.segments:
            self.segments = [self._create(0)]
        self._bases = [segment.base for segment in self.segments]

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    @property
    def min_offset(self) -> int:
        return self.segments[0].base

    @property
    def end(self) -> int:
        """The log offset the next record will get."""
        return self.active.end

    def check_contiguous(self) -> None:
        """Every segment must end where the next one begins; a gap is lost data."""
        for current, following in zip(self.segments, self.segments[1:]):
            if current.end != following.base:
                raise CorruptStoreError(
                    f"segment {current.path} ends at log offset {current.end} but the next "
                    f"segment {following.path.name} starts at {following.base}"
                )

    def room(self) -> int:
        """Bytes the active segment can still take (an empty one takes any record)."""
        size = self.active.size
        return self.segment_size - size if size else self.segment_size

    def append(self, parts: list[bytes]) -> None:
        """Write ``parts`` to the active segment with one system call."""
        if parts:
            self.active.write(b"".join(parts))

    def roll(self) -> None:
        """Start a new segment at the current end (the old one is fsynced first if asked)."""
        if self.fsync_on_roll:
            self.active.fsync()
        self.segments = [*self.segments, self._create(self.active.end)]
        self._bases = [segment.base for segment in self.segments]

    def locate(self, log_offset: int) -> Segment:
        """The segment holding ``log_offset``."""
        segments, bases = self.segments, self._bases
        index = bisect.bisect_right(bases, log_offset) - 1
        if index < 0 or log_offset >= segments[index].end:
            raise StoreError(f"log offset {log_offset} is outside the log")
        return segments[index]

    def truncate(self, log_offset: int) -> None:
        """Drop everything from ``log_offset`` on (recovery cuts a torn tail)."""
        keep = [segment for segment in self.segments if segment.base <= log_offset]
        for segment in self.segments[len(keep) :]:
            segment.delete()
        keep[-1].truncate(log_offset - keep[-1].base)
        self.segments = keep
        self._bases = [segment.base for segment in keep]
        fsync_directory(self.directory)

    def delete_oldest(self) -> Segment:
        """Remove the oldest segment (never the active one) and return it."""
        oldest, *rest = self.segments
        if not rest:
            raise StoreError("the active segment cannot be deleted")
        self.segments = rest
        self._bases = [segment.base for segment in rest]
        oldest.delete()
        return oldest

    def close(self) -> None:
        for segment in self.segments:
            segment.close()

    def _create(self, base: int) -> Segment:
        segment = Segment(self.directory / segment_name(base), base)
        fsync_directory(self.directory)
        return segment


def _base(path: Path) -> int:
    """The log offset a segment's name gives; a misnamed segment stops the open.

    Unlike a queue or index file, a segment is not derived from anything: skipping
    one would lose its records, so the store refuses to open until it is renamed
    or moved away.
    """
    base = named_offset(path, SUFFIX)
    if base is None:
        raise CorruptStoreError(
            f"{path}: not a commit-log segment name (expected {NAME_DIGITS} digits, the log offset "
            f"it begins at, then {SUFFIX}); rename or move the file away, nothing was changed")
    return base
