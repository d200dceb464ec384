"""`ConsumeQueue`: per (topic, queue), fixed-size entries pointing into the commit log.

Entry ``n`` of a queue is the message at queue offset ``n``: (log offset, size,
tag hash), 16 bytes, so a read by position is one multiplication, never a scan.
Entries live in pre-sized, memory-mapped files of ``entries_per_file`` entries
named by their first queue offset. A zero size marks an empty slot. The files
are not fsynced on append: recovery rebuilds them from the commit log. A queue
whose files are not a contiguous run of whole files below its last one (a file
lost or of the wrong size), or that has an empty slot with entries after it
(zeroed entries), is cut at the hole on open, logged (`store.queue_rebuilt`),
and recovery rebuilds the rest from the log (the checks: `queuefiles`). Other
files in the folder are not the queue's (`files.numbered_files`).

A queue also keeps the bytes its kept messages take in the log (``kept_bytes``,
the entries from ``kept_from`` on): added to on append, taken from on
truncation and retention (`forget_below`), saved in the checkpoint and
`settle`d after recovery, so a topic's size is known without reading the log.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import structlog

from broker.errors import CorruptStoreError
from broker.store.files import (
    RESERVE_CHUNK,
    allocated,
    flush_mapped,
    fsync_directory,
    numbered_files,
    reserve,
)
from broker.store.queuefiles import (
    ENTRY,
    SUFFIX,
    columns,
    file_name,
    first_damage,
    first_hole,
    per_file_on_disk,
    total_size,
)

log = structlog.get_logger("broker.store")


class QueueEntry(NamedTuple):
    """One consume-queue entry."""

    queue_offset: int
    log_offset: int
    size: int
    tag_hash: int


class ConsumeQueue:
    """The consume queue of one (topic, queue)."""

    def __init__(self, directory: Path, topic: str, queue: int, entries_per_file: int) -> None:
        self.directory = directory
        self.topic = topic
        self.queue = queue
        directory.mkdir(parents=True, exist_ok=True)
        found = {base: path.stat().st_size for base, path in numbered_files(directory, SUFFIX).items()}
        self.per_file = per_file_on_disk(found, entries_per_file)
        damage = first_damage(found, self.per_file)
        if damage is not None:
            found = self._cut(found, *damage)
        self._files: dict[int, mmap.mmap] = {}
        self._reserved: dict[int, int] = {}  # bytes allocated per file (`_reserve`)
        self._dirty: set[int] = set()
        for base in sorted(found):
            self._files[base] = self._map(self._path(base))
            self._reserved[base] = allocated(self._path(base))
        hole = first_hole(self._files, self.per_file, self._reserved)
        if hole is not None:
            self._empty_from(*hole)
        self.length = self._measure()
        self.kept_from = 0  # the bytes of the entries from here on are counted (`settle`)
        self.kept_bytes = 0

    @property
    def min_file_offset(self) -> int:
        """The first queue offset still on disk (retention removes whole files)."""
        return min(self._files, default=self.length - self.length % self.per_file)

    def put(self, queue_offset: int, log_offset: int, size: int, tag_hash: int) -> None:
        """Write the entry for ``queue_offset`` (idempotent: recovery may write it again)."""
        base = queue_offset - queue_offset % self.per_file
        mapped = self._files.get(base)
        if mapped is None:
            mapped = self._files[base] = self._map(self._path(base))
        self._reserve(base, queue_offset - base + 1)
        position = (queue_offset - base) * ENTRY.size
        if queue_offset >= self.kept_from:
            replaced = ENTRY.unpack_from(mapped, position)[1] if queue_offset < self.length else 0
            self.kept_bytes += size - replaced
        ENTRY.pack_into(mapped, position, log_offset, size, tag_hash)
        self._dirty.add(base)
        if queue_offset >= self.length:
            self.length = queue_offset + 1

    def put_packed(self, data: bytes) -> None:
        """Append already packed entries (16 bytes each) at the end of the queue."""
        size = ENTRY.size
        queue_offset, done, total = self.length, 0, len(data) // size
        self.kept_bytes += total_size(data)
        while done < total:
            base = queue_offset - queue_offset % self.per_file
            mapped = self._files.get(base)
            if mapped is None:
                mapped = self._files[base] = self._map(self._path(base))
            taken = min(total - done, base + self.per_file - queue_offset)
            self._reserve(base, queue_offset - base + taken)
            position = (queue_offset - base) * size
            mapped[position : position + taken * size] = data[done * size : (done + taken) * size]
            self._dirty.add(base)
            done += taken
            queue_offset += taken
        self.length = queue_offset

    def file_for(self, first: int, last: int) -> tuple[mmap.mmap, int] | None:
        """The file (and its first queue offset) holding entries ``first..last``, if one does.

        The writer packs entries straight into it, then calls `extend`.
        """
        base = first - first % self.per_file
        if last >= base + self.per_file:
            return None
        mapped = self._files.get(base)
        if mapped is None:
            mapped = self._files[base] = self._map(self._path(base))
        self._reserve(base, last - base + 1)
        return mapped, base

    def _reserve(self, base: int, entries: int) -> None:
        """Allocate the first ``entries`` slots of the file at ``base`` (and a chunk more) before
        they are written through its map (`broker.store.files.reserve`)."""
        needed = entries * ENTRY.size
        reserved = self._reserved.get(base, 0)
        if needed <= reserved:
            return
        upto = min(self.per_file * ENTRY.size, max(needed, reserved + RESERVE_CHUNK))
        reserve(self._path(base), upto)
        self._reserved[base] = upto

    def extend(self, length: int) -> None:
        """Entries up to ``length`` were written into the file `file_for` gave."""
        self._dirty.add((length - 1) - (length - 1) % self.per_file)
        self.kept_bytes += self.size_of(self.length, length)
        self.length = length

    def get(self, queue_offset: int, count: int) -> list[QueueEntry]:
        """Up to ``count`` entries from ``queue_offset`` (stops at an empty slot or the end)."""
        entries: list[QueueEntry] = []
        end = min(self.length, queue_offset + count)
        files = self._files
        while queue_offset < end:
            base = queue_offset - queue_offset % self.per_file
            mapped = files.get(base)
            if mapped is None:
                break
            stop = min(end, base + self.per_file)
            position = (queue_offset - base) * ENTRY.size
            for log_offset, size, tag_hash in ENTRY.iter_unpack(
                mapped[position : (stop - base) * ENTRY.size]
            ):
                if not size:
                    return entries
                entries.append(QueueEntry(queue_offset, log_offset, size, tag_hash))
                queue_offset += 1
        return entries

    def span(self, queue_offset: int, count: int) -> tuple[list[int], list[int]]:
        """The log offsets and sizes of up to ``count`` entries from ``queue_offset`` (as `get`,
        column-wise: no value per entry is built in Python)."""
        log_offsets: list[int] = []
        sizes: list[int] = []
        end = min(self.length, queue_offset + count)
        while queue_offset < end:
            base = queue_offset - queue_offset % self.per_file
            mapped = self._files.get(base)
            if mapped is None:
                break
            stop = min(end, base + self.per_file)
            found, lengths = columns(mapped[(queue_offset - base) * ENTRY.size : (stop - base) * ENTRY.size])
            if 0 in lengths:  # an empty slot ends the queue
                end = stop = queue_offset + lengths.index(0)
                found, lengths = found[: stop - queue_offset], lengths[: stop - queue_offset]
            if log_offsets:
                log_offsets += found
                sizes += lengths
            else:
                log_offsets, sizes = found, lengths
            queue_offset = stop
        return log_offsets, sizes

    def truncate(self, queue_offset: int) -> None:
        """Forget every entry from ``queue_offset`` on."""
        self.kept_bytes -= self.size_of(max(queue_offset, self.kept_from), self.length)
        for offset in range(queue_offset, self.length):
            base = offset - offset % self.per_file
            if base in self._files:
                ENTRY.pack_into(self._files[base], (offset - base) * ENTRY.size, 0, 0, 0)
                self._dirty.add(base)
        self.length = min(self.length, queue_offset)

    def trim(self, log_end: int) -> None:
        """Drop trailing entries that point at or past ``log_end`` (a truncated log tail)."""
        offset = self.length
        while offset > 0:
            entry = self.get(offset - 1, 1)
            if entry and entry[0].log_offset + entry[0].size <= log_end:
                break
            offset -= 1
        if offset < self.length:
            self.truncate(offset)

    def first_offset(self, log_min: int) -> int:
        """The lowest queue offset whose entry points at or above ``log_min`` (bisection)."""
        low, high = self.min_file_offset, self.length
        while low < high:
            middle = (low + high) // 2
            entry = self.get(middle, 1)
            if entry and entry[0].log_offset >= log_min:
                high = middle
            else:
                low = middle + 1
        return low

    def size_of(self, first: int, stop: int) -> int:
        """The bytes in the log of the entries ``first .. stop - 1`` on disk."""
        total = 0
        while first < stop:
            base = first - first % self.per_file
            end = min(stop, base + self.per_file)
            mapped = self._files.get(base)
            if mapped is not None:
                total += total_size(mapped[(first - base) * ENTRY.size : (end - base) * ENTRY.size])
            first = end
        return total

    def settle(self, first: int, saved: tuple[int, int, int] | None) -> None:
        """Count the kept bytes from queue offset ``first`` (retention's start) after recovery.

        ``saved`` is what the checkpoint recorded (length, ``kept_from``, ``kept_bytes``):
        only the entries after its length are then read. Without it, or if the queue
        is now shorter than it was, every kept entry is read once.
        """
        if saved is not None and saved[1] <= first and saved[1] <= saved[0] <= self.length:
            self.kept_from, self.kept_bytes = saved[1], saved[2] + self.size_of(saved[0], self.length)
            self.forget_below(first)
        else:
            self.kept_from, self.kept_bytes = first, self.size_of(first, self.length)

    def forget_below(self, first: int) -> None:
        """Retention removed the messages below queue offset ``first``: stop counting them."""
        if first > self.kept_from:
            self.kept_bytes -= self.size_of(self.kept_from, min(first, self.length))
            self.kept_from = first

    def drop_files_below(self, log_min: int) -> int:
        """Delete whole files whose every entry points below ``log_min``; return how many."""
        dropped = 0
        for base in sorted(self._files)[:-1]:
            last = self.get(base + self.per_file - 1, 1)
            if not last or last[0].log_offset >= log_min:
                break
            self._files = {k: v for k, v in self._files.items() if k != base}
            self._dirty.discard(base)
            self._path(base).unlink(missing_ok=True)
            dropped += 1
        return dropped

    def take_dirty(self) -> list[tuple[Path, mmap.mmap]]:
        """The files written since the last call; the caller flushes them (writer lock held)."""
        dirty, self._dirty = self._dirty, set()
        return [(self._path(base), self._files[base])
                for base in dirty if base in self._files]

    def close(self) -> None:
        for path, mapped in self.take_dirty():
            flush_mapped(path, mapped)
        files, self._files = self._files, {}
        for mapped in files.values():
            mapped.close()

    def lost_start(self, queue_offset: int, log_offset: int) -> None:
        """Log that the commit log holds ``queue_offset`` (at ``log_offset``) below the first file.

        Its first file is lost (retention would have kept it); recovery rebuilds it.
        """
        log.warning("store.queue_rebuilt", topic=self.topic, queue=self.queue,
                    file=str(self._path(queue_offset - queue_offset % self.per_file)),
                    reason=(f"the log holds queue offset {queue_offset} at log offset {log_offset}, "
                            f"below its first file {file_name(self.min_file_offset)}"), dropped=[])

    def _path(self, base: int) -> Path:
        return self.directory / file_name(base)

    def _cut(self, found: dict[int, int], at: int, reason: str) -> dict[int, int]:
        """Delete the files from queue offset ``at`` on (a hole below the end); return the rest.

        Recovery rebuilds what they held from the commit log: the queue is then
        shorter than the checkpoint vouched for, or the entries cut lie after it.
        """
        self._rebuild_from(at, sorted(base for base in found if base >= at), reason)
        return {base: size for base, size in found.items() if base < at}

    def _empty_from(self, at: int, reason: str) -> None:
        """Empty every slot from queue offset ``at`` on (a hole inside a file), as `_cut` does files."""
        base = at - at % self.per_file
        mapped = self._files[base]

        def empty() -> None:
            mapped[(at - base) * ENTRY.size :] = bytes((base + self.per_file - at) * ENTRY.size)
            flush_mapped(self._path(base), mapped)

        doomed = sorted(later for later in self._files if later > base)
        for later in doomed:
            self._files.pop(later).close()
        self._rebuild_from(base, doomed, reason, empty)

    def _rebuild_from(self, base: int, doomed: list[int], reason: str,
                      cut: Callable[[], None] = lambda: None) -> None:
        """Log that the queue is rebuilt from the file at ``base`` (`store.queue_rebuilt`), ``cut``
        it, and delete the files ``doomed``, durably; recovery refills it all from the log."""
        log.warning("store.queue_rebuilt", topic=self.topic, queue=self.queue,
                    file=str(self._path(base)), reason=reason,
                    dropped=[self._path(doomed_base).name for doomed_base in doomed])
        try:
            cut()
            for doomed_base in doomed:
                self._path(doomed_base).unlink()
            fsync_directory(self.directory)
        except OSError as exc:
            raise CorruptStoreError(f"consume queue {self.topic}/{self.queue}: {reason}, and its "
                                    f"files cannot be rebuilt: {exc}") from exc

    def _map(self, path: Path) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = self.per_file * ENTRY.size
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def _measure(self) -> int:
        """The number of entries: the first empty slot of the last file, by bisection."""
        if not self._files:
            return 0
        base = max(self._files)
        low, high = 0, min(self.per_file, self._reserved.get(base, 0) // ENTRY.size)  # a hole is empty
        mapped = self._files[base]
        while low < high:
            middle = (low + high) // 2
            if ENTRY.unpack_from(mapped, middle * ENTRY.size)[1]:
                low = middle + 1
            else:
                high = middle
        return base + low


