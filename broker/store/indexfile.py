"""`IndexFile`: one file of the key index, a hash table on disk (RocketMQ's index file).

A header (time range, the log offsets it covers, entry count and capacity,
slot count, sealed flag), ``slots`` heads of chains, then append-only entries
(hash, log offset, size, store time, previous entry). A lookup reads one slot
and walks its chain, newest first. A file is named by the log offset of its
first entry; one whose size or header does not add up is refused on open with
a `CorruptStoreError` naming it (`KeyIndex` then rebuilds it from the log).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import starmap
from pathlib import Path

from broker.errors import CorruptStoreError
from broker.store.files import RESERVE_CHUNK, flush_mapped, reserve

HEADER = struct.Struct("<qqQQIIII")  # begin ms, end ms, begin/end log offset, count, cap, slots, sealed
SLOT = struct.Struct("<I")
ENTRY = struct.Struct("<IQIqI")  # hash, log offset, size, store time ms, previous entry number
SUFFIX = ".idx"


class _PackedHeads:
    """Slot heads read and written through `struct` (hosts that are not little endian)."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self._map = mapped

    def __getitem__(self, slot: int) -> int:
        return int(SLOT.unpack_from(self._map, HEADER.size + slot * SLOT.size)[0])

    def __setitem__(self, slot: int, number: int) -> None:
        SLOT.pack_into(self._map, HEADER.size + slot * SLOT.size, number)


def _slot_heads(mapped: mmap.mmap, slots: int) -> memoryview | _PackedHeads:
    """The slot table as an array of u32 (a direct view where the host is little endian)."""
    if sys.byteorder == "little":
        return memoryview(mapped)[HEADER.size : HEADER.size + slots * SLOT.size].cast("I")
    return _PackedHeads(mapped)


def _file_size(slots: int, capacity: int) -> int:
    """The size of an index file of ``slots`` slot heads and ``capacity`` entries."""
    return HEADER.size + slots * SLOT.size + capacity * ENTRY.size


def _damage(header: bytes, size: int, begin_log_offset: int) -> str | None:
    """Why an index file with this header and size, named ``begin_log_offset``, cannot be trusted."""
    if len(header) < HEADER.size:
        return f"{size} bytes, shorter than its header"
    _, _, begin, end, count, capacity, slots, sealed = HEADER.unpack(header)
    if not slots or not capacity:
        return "its header is zeroed (no slots or no capacity)"
    expected = _file_size(slots, capacity)
    if size != expected:
        return f"{size} bytes where its header ({slots} slots, {capacity} entries) says {expected}"
    if begin != begin_log_offset or end < begin or count > capacity or sealed > 1:
        return (f"its header is inconsistent (log offsets {begin}..{end} for a file named "
                f"{begin_log_offset}, {count} of {capacity} entries, sealed {sealed})")
    return None


class IndexFile:
    """One index file; a writer appends entries, readers walk chains concurrently."""

    def __init__(self, path: Path, begin_log_offset: int) -> None:
        """Open an existing index file; `CorruptStoreError` names it if it cannot be trusted."""
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            reason = _damage(os.pread(fd, HEADER.size, 0), os.fstat(fd).st_size, begin_log_offset)
            if reason:
                raise CorruptStoreError(f"index file {path.name}: {reason}")
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        (self.begin_ms, self.end_ms, self.begin_log_offset, self.end_log_offset,
         self.count, self.capacity, self.slots, self.sealed) = HEADER.unpack_from(self._map, 0)
        self._entries = HEADER.size + self.slots * SLOT.size
        self._reserved = 0  # bytes allocated from the start (`broker.store.files.reserve`)
        self._heads = _slot_heads(self._map, self.slots)
        while not self.sealed and self.count < self.capacity and self._entry(self.count)[2]:
            self.count += 1  # entries a killed writer added after its last header update

    @classmethod
    def create(cls, path: Path, slots: int, capacity: int, begin_log_offset: int) -> IndexFile:
        """A new, empty index file for records from ``begin_log_offset`` on."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _file_size(slots, capacity))
            os.pwrite(fd, HEADER.pack(0, 0, begin_log_offset, begin_log_offset,
                                      0, capacity, slots, 0), 0)
        finally:
            os.close(fd)
        return cls(path, begin_log_offset)

    def _entry(self, position: int) -> tuple[int, int, int, int, int]:
        return ENTRY.unpack_from(self._map, self._entries + position * ENTRY.size)

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def add_many(self, hashes: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                 times: Sequence[int]) -> int:
        """Add entries (hash, log offset, size, store ms: one column each) until full.

        Returns how many fit. Entries are written first, then the slot heads, so a
        concurrent reader never follows a slot to an entry not yet written.
        """
        room = self.capacity - self.count
        if len(hashes) > room:
            hashes, offsets, sizes, times = hashes[:room], offsets[:room], sizes[:room], times[:room]
        if not hashes:
            return 0
        mapped, heads, first = self._map, self._heads, self.count + 1
        numbers = range(first, first + len(hashes))
        slots = list(map(self.slots.__rmod__, hashes))
        previous = list(map(heads.__getitem__, slots))
        distinct = len(set(slots)) == len(slots)
        if not distinct:  # chains within the batch: link them in order
            latest = dict(zip(slots, previous))
            for position, (slot, number) in enumerate(zip(slots, numbers)):
                previous[position], latest[slot] = latest[slot], number
        at = self._entries + self.count * ENTRY.size
        data = b"".join(map(ENTRY.pack, hashes, offsets, sizes, times, previous))
        if at + len(data) > self._reserved:  # slots and entries, before the map writes them
            upto = min(len(self._map), max(at + len(data), self._reserved + RESERVE_CHUNK))
            reserve(self.path, upto)
            self._reserved = upto
        mapped[at : at + len(data)] = data
        newest = zip(slots, numbers) if distinct else dict(zip(slots, numbers)).items()
        deque(starmap(heads.__setitem__, newest), maxlen=0)
        self.begin_ms = min(times) if self.count == 0 else min(self.begin_ms, min(times))
        self.end_ms = max(self.end_ms, max(times))
        self.count += len(hashes)
        return len(hashes)

    def advance(self, end_log_offset: int) -> None:
        """Record that every record before ``end_log_offset`` is indexed (header only)."""
        self.end_log_offset = end_log_offset
        HEADER.pack_into(self._map, 0, self.begin_ms, self.end_ms, self.begin_log_offset,
                         end_log_offset, self.count, self.capacity, self.slots, self.sealed)

    def find(self, hashed: int, begin_ms: int, end_ms: int) -> Iterator[tuple[int, int, int]]:
        """(log offset, size, store ms) of entries with ``hashed`` in the time range, newest first."""
        mapped = self._map
        number = SLOT.unpack_from(mapped, HEADER.size + (hashed % self.slots) * SLOT.size)[0]
        limit = self.capacity  # a slot only ever names an entry already written
        while 0 < number <= limit:
            entry_hash, log_offset, size, store_ms, previous = ENTRY.unpack_from(
                mapped, self._entries + (number - 1) * ENTRY.size
            )
            if entry_hash == hashed and begin_ms <= store_ms <= end_ms:
                yield log_offset, size, store_ms
            if previous >= number:
                return
            number = previous

    def seal(self) -> None:
        """Mark the file complete and force it to disk; it is never written again."""
        self.sealed = 1
        self.advance(self.end_log_offset)
        self.flush()

    def flush(self) -> None:
        flush_mapped(self.path, self._map)

    def close(self) -> None:
        if isinstance(self._heads, memoryview):
            self._heads.release()
        self._map.close()

    def delete(self) -> None:
        """Remove the file; the mapping goes when no reader holds it any more."""
        self.path.unlink(missing_ok=True)
