"""`KeyIndex`: find messages by key or message id within a time range, without scanning.

Modelled on RocketMQ's index files: each file (`IndexFile`, in `indexfile`) is a
hash table on disk, a header, ``slots`` heads of chains, then append-only entries
(hash, log offset, size, store time, previous entry). A lookup reads one slot and
walks its chain, newest first. Hashes (here) are CRC32C (stable across processes); collisions are
resolved by the caller, which reads each candidate record and compares.
Files are named by the log offset of their first entry; a full file is sealed
(fsynced) and a new one started. The open file is rebuilt after a crash.

Index files are derived from the log: a file found damaged on open (a size or
header that does not add up, a break in the chain of log offsets from one file
to the next) is deleted with every later one, logged (`store.index_rebuilt`),
and recovery re-indexes that part of the log. A lost first file is found by
recovery (`recovery._lost_starts`), which then re-indexes the whole log.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import structlog
from crc32c import crc32c

from broker.errors import CorruptStoreError
from broker.store.files import fsync_directory, named_offset, numbered_files
from broker.store.indexfile import SUFFIX, IndexFile

log = structlog.get_logger("broker.store")

_topic_seeds: dict[bytes, int] = {}


def topic_seed(topic: bytes) -> int:
    """The CRC32C seed a topic gives its keys' hashes (cached: there are few topics)."""
    seed = _topic_seeds.get(topic)
    if seed is None:
        seed = _topic_seeds.setdefault(topic, crc32c(topic + b"\x00"))
    return seed


def key_hash(topic: bytes, key: bytes) -> int:
    """The index hash of a message key within its topic."""
    return crc32c(key, topic_seed(topic))


ID_SEED = 0x1D  # of `id_hash`


def id_hash(message_id: bytes) -> int:
    """The index hash of a message id."""
    return crc32c(message_id, ID_SEED)


STORE_ID_LENGTH = 24  # the length of the ids the store makes


def offset_in_id(message_id: bytes) -> int | None:
    """The log offset a store-made id names (8 hex digits of instance, 16 of offset), if any.

    Ids the store makes say where their record is, as RocketMQ's offset message
    ids do, so they need no index entry: a lookup reads the record and compares.
    """
    if len(message_id) != STORE_ID_LENGTH:
        return None
    try:
        return int(message_id[8:], 16)
    except ValueError:
        return None


class KeyIndex:
    """The index files of one store directory, oldest first; the last one takes new entries."""

    def __init__(self, directory: Path, slots: int, capacity: int) -> None:
        self.directory = directory
        self.slots = slots
        self.capacity = capacity
        directory.mkdir(parents=True, exist_ok=True)
        self.files: list[IndexFile] = []
        for begin, path in sorted(numbered_files(directory, SUFFIX).items()):
            try:
                self.files.append(IndexFile(path, begin))
            except CorruptStoreError as exc:
                self._rebuild_from(len(self.files), path, str(exc))
                break
            reason = _unchained(self.files[-2:])
            if reason:
                self._rebuild_from(len(self.files) - 2, self.files[-2].path, reason)
                break

    @property
    def end_log_offset(self) -> int | None:
        """Every record before this log offset is indexed (None: no file yet)."""
        return self.files[-1].end_log_offset if self.files else None

    def add_many(self, hashes: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                 times: Sequence[int]) -> None:
        """Index entries (one column per field), starting new files as they fill."""
        while hashes:
            if not self.files or self.files[-1].full:
                self._start(offsets[0])
            done = self.files[-1].add_many(hashes, offsets, sizes, times)
            hashes, offsets, sizes, times = hashes[done:], offsets[done:], sizes[done:], times[done:]

    def advance(self, end_log_offset: int) -> None:
        if self.files:
            self.files[-1].advance(end_log_offset)

    def find(self, hashed: int, begin_ms: int, end_ms: int) -> Iterator[tuple[int, int, int]]:
        """Candidate (log offset, size, store ms) for ``hashed``, newest file first."""
        for index_file in reversed(self.files):
            if index_file.count and index_file.begin_ms <= end_ms and index_file.end_ms >= begin_ms:
                yield from index_file.find(hashed, begin_ms, end_ms)

    def drop_from(self, position: int) -> None:
        """Delete index files ``position`` and later (recovery rebuilds them)."""
        for index_file in self.files[position:]:
            index_file.delete()
        self.files = self.files[:position]
        fsync_directory(self.directory)

    def rebuild_all(self, reason: str) -> None:
        """Delete every index file, logged (`store.index_rebuilt`): recovery re-indexes the whole log."""
        if self.files:
            self._rebuild_from(0, self.files[0].path, reason)

    def drop_below(self, log_min: int) -> int:
        """Delete sealed files that only index records below ``log_min``; return how many."""
        keep = [f for f in self.files if not (f.sealed and f.end_log_offset <= log_min)]
        dropped = [f for f in self.files if f not in keep]
        self.files = keep
        for index_file in dropped:
            index_file.delete()
        return len(dropped)

    def recent(self) -> list[IndexFile]:
        """The files a checkpoint must flush (a file is sealed, hence flushed, when full)."""
        return self.files[-1:]

    def close(self) -> None:
        for index_file in self.files:
            index_file.flush()
            index_file.close()

    def _start(self, log_offset: int) -> None:
        if self.files:
            self.files[-1].advance(log_offset)
            self.files[-1].seal()
        path = self.directory / f"{log_offset:020d}{SUFFIX}"
        self.files = [*self.files, IndexFile.create(path, self.slots, self.capacity, log_offset)]
        fsync_directory(self.directory)

    def _rebuild_from(self, position: int, damaged: Path, reason: str) -> None:
        """Delete ``damaged`` (file ``position``) and every later file: recovery re-indexes them
        from the commit log, from where the files kept end."""
        doomed = sorted(p for p in self.directory.glob("*" + SUFFIX)
                        if named_offset(p, SUFFIX) is not None and p.name >= damaged.name)
        log.warning("store.index_rebuilt", file=str(damaged), reason=reason,
                    dropped=[p.name for p in doomed])
        for index_file in self.files[position:]:
            index_file.close()
        self.files = self.files[:position]
        try:
            for path in doomed:
                path.unlink(missing_ok=True)
            fsync_directory(self.directory)
        except OSError as exc:
            raise CorruptStoreError(f"index file {damaged.name} is damaged ({reason}) and cannot "
                                    f"be rebuilt: {exc}") from exc


def _unchained(pair: Sequence[IndexFile]) -> str | None:
    """Why two consecutive index files do not chain (the first sealed, ending where the next begins)."""
    if len(pair) < 2:
        return None
    previous, following = pair
    if not previous.sealed:
        return f"not sealed, yet {following.path.name} follows it"
    if previous.end_log_offset != following.begin_log_offset:
        return (f"ends at log offset {previous.end_log_offset}, but the next file, "
                f"{following.path.name}, begins at {following.begin_log_offset}")
    return None
