"""`MessageStore`: the facade over commit log, consume queues, key index and recovery.

One writer lock serialises writes (write, dispatch to the consume queues and
the key index); readers never take it. Under `sync`, a committer thread
encodes and writes every waiting producer's records as one batch (group
commit); a flusher thread fsyncs the log, a maintenance thread writes
checkpoints and runs retention (`maintenance.Maintenance`).
"""

from __future__ import annotations

import errno
import os
import threading
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Self

import structlog

from broker.errors import (
    DiskFullError,
    InvalidRequestError,
    StoreClosedError,
    StoreError,
)
from broker.store import checkpoint, retention
from broker.store.commitlog import CommitLog
from broker.store.config import FlushPolicy, StoreConfig
from broker.store.flush import Flusher
from broker.store.groupcommit import GroupCommit, Journal
from broker.store.keyindex import KeyIndex, id_hash, key_hash, offset_in_id
from broker.store.maintenance import Maintenance, RetentionGuard
from broker.store.prepare import Prepared, prepare
from broker.store.queues import QueueTable
from broker.store.reader import lookup, read_frame_at, read_on, read_span
from broker.store.recent import RecentRecords
from broker.store.record import (
    Appended,
    AppendResult,
    Record,
    RecordColumns,
    StoredBatch,
    StoredMessage,
)
from broker.store.recovery import RecoveryReport, recover
from broker.store.runs import find_run, split_run_id
from broker.store.segment import Segment
from broker.store.writer import BatchWriter

log = structlog.get_logger("broker.store")

FOREVER_MS = 1 << 62


class MessageStore:
    """A durable, crash-safe message store in one directory; thread-safe."""

    def __init__(self, path: str | os.PathLike[str], config: StoreConfig | None = None) -> None:
        self.path = Path(path)
        self.config = config or StoreConfig()
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)  # messages: the owner's alone
        self._lock_fd = checkpoint.lock(self.path)
        self._writer = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        self._instance = os.urandom(4).hex().encode()
        try:
            self.recovery = self._open()
        except BaseException as exc:
            self._release()
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"store {self.path} cannot be opened: the disk is full ({exc}); "
                                    "it opens once space is freed") from exc
            raise
        self._recent = RecentRecords(self.config.recent_bytes)
        self._batch_writer = BatchWriter(self._log, self._queues, self._index, self._instance,
                                         self._recent)
        self._visible = self._log.end
        self._flusher = Flusher(self.config.flush, self.config.flush_interval,
                                self.config.flush_bytes, self._flush_target, self._log.end)
        self._group: GroupCommit | None = None
        if self.config.flush is FlushPolicy.SYNC:
            self._group = GroupCommit(self._check_disk, self._commit, self._flusher.sync,
                                      self.config.max_record_size, self.config.group_commit_wait)
        self._maintenance.start()

    def _open(self) -> RecoveryReport:
        marker = checkpoint.crash_marker(self.path)
        saved = checkpoint.load(self.path)
        self._log = CommitLog(self.path / "commitlog", self.config.segment_size,
                              fsync_on_roll=self.config.flush is not FlushPolicy.NONE)
        self._queues = QueueTable(self.path / "consumequeue", self.config.queue_file_entries)
        self._index = KeyIndex(self.path / "index", self.config.index_slots,
                               self.config.index_entries)
        report = recover(self._log, self._queues, self._index, saved, marker, self.config)
        self._queues.settle(self._log.min_offset, saved.queues if saved else {}, saved.kept if saved else {})
        self._maintenance = Maintenance(self.path, self.config, self._log, self._queues, self._index,
                                        self._writer)
        self._maintenance.checkpoint()
        checkpoint.mark_open(self.path)
        log.info("store.opened", path=str(self.path), crashed=report.crashed, log_end=self._log.end,
                 queues=len(self._queues.places()))
        return report

    # -- writing ---------------------------------------------------------------------------

    def append(self, records: Sequence[Record]) -> list[AppendResult]:
        """Append ``records`` in order; under `sync` returns only once they are fsynced."""
        self._check_open()
        return self.append_columns(RecordColumns.of(records)).results() if records else []

    def append_columns(self, records: RecordColumns) -> Appended:
        """`append` for records column by column, their places column by column."""
        self._check_open()
        if self._group is not None:  # checks the disk once per generation
            return self._group.append(records)
        return self._append_now(records)

    async def append_async(self, records: Sequence[Record]) -> list[AppendResult]:
        """`append` for asyncio code (see `append_columns_async`)."""
        self._check_open()
        return (await self.append_columns_async(RecordColumns.of(records))).results() if records else []

    async def append_columns_async(self, records: RecordColumns) -> Appended:
        """`append_columns` for asyncio code: the write runs here, and under `sync` the fsync is
        awaited.

        The write only reaches the page cache, so it runs on the caller's loop (the
        tasks that append in one pass of the loop write together); the committer
        thread fsyncs meanwhile (RocketMQ's GroupCommitService), so the next
        writes go on while the disk works. Many tasks appending at once share one
        fsync and are woken with one call into their loop, which is how the
        broker's server takes concurrent producers.
        """
        self._check_open()
        if self._group is not None:
            return await self._group.append_async(records)
        return self._append_now(records)

    def attach_journal(self, journal: Journal) -> None:
        """Write and fsync ``journal`` in the same group commit as the appends (`sync` only)."""
        self._committer().attach(journal)

    def journal_synced(self) -> None:
        """Return once the attached journals are fsynced past what they held at the call."""
        self._check_open()
        self._committer().synced()

    async def journal_synced_async(self) -> None:
        """`journal_synced` for asyncio code: the committer's pass is awaited."""
        self._check_open()
        await self._committer().synced_async()

    def _committer(self) -> GroupCommit:
        if self._group is None:
            raise StoreError(f"store {self.path}: a journal rides the group commit, which only "
                             f"flush='sync' has (flush={self.config.flush.value!r})")
        return self._group

    def _append_now(self, records: RecordColumns) -> Appended:
        """Write ``records`` on the caller's thread (no fsync to wait for: `async`, `none`)."""
        self._check_disk()
        return self._commit(prepare(records, self.config.max_record_size))[0]

    def _commit(self, prepared: Prepared) -> tuple[Appended, int]:
        """Write a prepared batch under the writer lock; return its places and the log end."""
        with self._writer:
            self._check_open()
            try:
                appended = self._batch_writer.write(prepared, self.config.clock.time())
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise self._failed(exc) from exc
                log.error("store.append_refused", path=str(self.path), error=repr(exc))
                self._maintenance.due()
                raise DiskFullError(f"append to {self.path}: the disk is full ({exc}); the batch "
                                    "was cut back whole and the next append may succeed") from exc
            except BaseException as exc:
                raise self._failed(exc) from exc
            self._visible = end = self._log.end
            self._flusher.wrote(end)
        return appended, end

    def _failed(self, exc: BaseException) -> StoreError:
        """An append failed in a way the store cannot undo: every later call is refused."""
        self._failure = exc
        log.error("store.append_failed", error=repr(exc))
        return StoreError(f"append to {self.path} failed; reopen the store")

    def _check_disk(self) -> None:
        usage = self.config.disk_usage(self.path)
        if usage >= self.config.refuse_at:
            log.error("store.append_refused", path=str(self.path), disk_usage=round(usage, 4))
            self._maintenance.due()
            raise DiskFullError(
                f"disk holding {self.path} is {usage:.1%} full, at or above "
                f"refuse_at={self.config.refuse_at:.0%}: appends are refused until retention frees "
                "space (consumer groups catching up, or messages expiring) or an operator does"
            )
        if usage >= self.config.clean_at:
            self._maintenance.due()

    # -- reading ---------------------------------------------------------------------------

    def read(self, topic: str, queue: int, queue_offset: int, max_count: int = 32) -> list[StoredMessage]:
        """Up to ``max_count`` messages of (topic, queue) from ``queue_offset`` on.

        Messages retention removed are left out: the first one returned may then
        have a higher queue offset than asked for (see `min_offset`).
        """
        return self.read_batch(topic, queue, queue_offset, max_count).messages()

    def read_batch(self, topic: str, queue: int, queue_offset: int, max_count: int = 32,
                   max_bytes: int | None = None, or_one: bool = True) -> StoredBatch:
        """`read`, column-wise: one list per field (the delivery engine's read); with ``max_bytes``,
        only the messages whose records fit in that many bytes together, cut from the consume
        queue's sizes before a record is read (``or_one``: the first one even if it alone does not)."""
        self._check_open()
        if queue_offset < 0 or max_count < 0:
            raise InvalidRequestError(
                f"read of {topic}/{queue}: queue_offset={queue_offset} and "
                f"max_count={max_count} must be >= 0"
            )
        consume_queue = self._queues.get(topic, queue)
        if consume_queue is None or not max_count:
            return StoredBatch(topic, queue, *([] for _ in StoredBatch._fields[2:]))
        log_offsets, sizes = consume_queue.span(queue_offset, max_count)
        log_min = self._log.min_offset
        if ((log_offsets[0] < log_min if log_offsets else queue_offset < consume_queue.length)
                and queue_offset < consume_queue.min_file_offset + consume_queue.per_file):
            first = consume_queue.first_offset(log_min)  # retention removed what lies below
            if first > queue_offset:
                queue_offset = first
                log_offsets, sizes = consume_queue.span(queue_offset, max_count)
        if max_bytes is not None and sizes:
            fitting = max(int(or_one), bisect_right(list(accumulate(sizes)), max_bytes))
            log_offsets, sizes = log_offsets[:fitting], sizes[:fitting]
        return read_span(self._log, (topic, queue), queue_offset, log_offsets, sizes,
                         self._visible_end(), self.config.read_chunk, self.config.skip_corrupt,
                         self._recent)

    def lookup_key(self, topic: str, key: str, begin: float, end: float,
                   max_count: int = 64) -> list[StoredMessage]:
        """Messages of ``topic`` with ``key`` stored between ``begin`` and ``end`` (log order)."""
        self._check_open()
        found = self._lookup(key_hash(topic.encode(), key.encode()), int(begin * 1000),
                             int(end * 1000), max_count,
                             lambda m: m.topic == topic and m.key == key
                             and begin <= m.store_time <= end)
        return sorted(found, key=lambda message: message.log_offset)

    def lookup_id(self, message_id: str) -> StoredMessage | None:
        """The message with ``message_id``, if the store still holds it."""
        self._check_open()
        log_offset = offset_in_id(message_id.encode())
        if log_offset is not None:
            message = read_frame_at(self._log, log_offset, self._visible_end())
            if message is not None and message.message_id == message_id:
                return message
        found = self._indexed(message_id)
        if found is not None:
            return found
        run = split_run_id(message_id)
        if run is None or not run[1]:
            return None
        batch_id, position = run
        return self.lookup_run(batch_id, position + 1)[position]  # read on from the run's start

    def lookup_run(self, batch_id: str, count: int) -> list[StoredMessage | None]:
        """The records of ids ``batch_id.0 .. batch_id.(count-1)`` (`broker.store.runs`) that the
        store holds, None for the others."""
        self._check_open()
        return find_run(batch_id, count, self._indexed,
                        lambda first: read_on(self._log, first.log_offset, self._visible_end()))

    def _indexed(self, message_id: str) -> StoredMessage | None:
        """The record of ``message_id`` by its own entry in the id index."""
        found = self._lookup(id_hash(message_id.encode()), 0, FOREVER_MS, 1,
                             lambda m: m.message_id == message_id)
        return found[0] if found else None

    def _lookup(self, hashed: int, begin_ms: int, end_ms: int, max_count: int,
                matches: Callable[[StoredMessage], bool]) -> list[StoredMessage]:
        candidates = self._index.find(hashed, begin_ms, end_ms)
        return lookup(self._log, candidates, self._visible_end(), max_count, matches)

    def max_offset(self, topic: str, queue: int) -> int:
        """The queue offset the next message of (topic, queue) will get."""
        consume_queue = self._queues.get(topic, queue)
        return consume_queue.length if consume_queue else 0

    def min_offset(self, topic: str, queue: int) -> int:
        """The lowest queue offset of (topic, queue) whose message retention has kept."""
        consume_queue = self._queues.get(topic, queue)
        return consume_queue.first_offset(self._log.min_offset) if consume_queue else 0

    def kept_bytes(self, topic: str, queue: int) -> int:
        """The bytes the kept messages of (topic, queue) take in the log (a running total)."""
        consume_queue = self._queues.get(topic, queue)
        return consume_queue.kept_bytes if consume_queue else 0

    def queues(self) -> list[tuple[str, int]]:
        """Every (topic, queue) that has ever held a message."""
        return self._queues.places()

    def _visible_end(self) -> int:
        """Readers see records up to here: under `sync`, only what an fsync covered."""
        if self.config.flush is FlushPolicy.SYNC:
            return min(self._flusher.flushed, self._visible)
        return self._visible

    # -- durability and retention ------------------------------------------------------------

    def checkpoint(self) -> None:
        """Flush the consume queues and log, then record how far recovery may trust them."""
        if not self._closed:
            self._maintenance.checkpoint()

    def observe_fsync(self, observer: Callable[[float], None] | None) -> None:
        """Tell ``observer`` the seconds each fsync of the commit log takes (None: nobody)."""
        self._flusher.on_fsync = observer

    def set_retention_guard(self, guard: RetentionGuard | None) -> None:
        """Tell retention what consumer groups still need (the delivery layer supplies it)."""
        self._maintenance.set_guard(guard)

    def clean(self) -> list[retention.Deletion]:
        """Run retention now; returns the deleted segments."""
        self._check_open()
        return self._maintenance.clean()

    def _flush_target(self, end: int) -> Segment:
        return self._log.locate(end - 1)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush everything, write a final checkpoint and mark a clean shutdown."""
        self._shutdown(clean=True)

    def _shutdown(self, clean: bool) -> None:
        """Stop; ``clean=False`` leaves the files as a crash would (tests use it)."""
        with self._writer:
            if self._closed:
                return
            self._closed = True
        self._maintenance.stop()
        if self._group is not None:
            self._group.stop()
        self._flusher.stop()
        if clean and self._failure is None:
            try:
                self._maintenance.checkpoint()
                checkpoint.mark_closed(self.path)
            except OSError as exc:  # a full disk: the next open recovers as after a crash
                log.error("store.checkpoint_failed", path=str(self.path), error=str(exc),
                          then="the next open recovers the files as after a crash")
                clean = False
        self._release()
        self._recent.clear()
        log.info("store.closed", path=str(self.path), clean=clean)

    def _release(self) -> None:
        for part in ("_queues", "_index", "_log"):
            if hasattr(self, part):
                getattr(self, part).close()
        checkpoint.unlock(self._lock_fd)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")
        if self._failure is not None:
            raise StoreError(f"store {self.path} failed earlier ({self._failure!r}); reopen it")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
