"""`Maintenance`: a store's checkpoints and retention, and the thread that runs them.

A checkpoint flushes the consume queues, the key index and the log segments
written since the last one, then records how far recovery may trust them
(`checkpoint`). Retention deletes whole segments (`retention`), never below
what the retention guard says consumer groups still need unless the disk is
filling; it runs every ``retention_interval``, or at the next tick once an
append found the disk filling (`due`). The writer lock is the store's: a
checkpoint reads the log's end and the queues' lengths under it, and the
files are dropped under it, so no append interleaves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from broker.errors import BrokerError
from broker.store import checkpoint, retention
from broker.store.commitlog import CommitLog
from broker.store.config import StoreConfig
from broker.store.files import flush_mapped
from broker.store.keyindex import KeyIndex
from broker.store.queues import QueueTable

log = structlog.get_logger("broker.store")

RetentionGuard = Callable[[], Mapping[tuple[str, int], int]]
"""Returns, per (topic, queue), the lowest queue offset any consumer group still needs."""


class Maintenance:
    """Checkpoints and retention over a store's log, consume queues and key index in ``path``."""

    def __init__(self, path: Path, config: StoreConfig, commit_log: CommitLog, queues: QueueTable,
                 index: KeyIndex, writer: threading.Lock) -> None:
        self._path = path
        self._config = config
        self._log = commit_log
        self._queues = queues
        self._index = index
        self._writer = writer
        self._checkpointed = commit_log.min_offset - 1  # the first checkpoint fsyncs every segment
        self._guard: RetentionGuard | None = None
        self._due = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Checkpoint every ``checkpoint_interval`` (if any) and run retention, on a thread."""
        if self._config.checkpoint_interval:
            self._thread = threading.Thread(target=self._run, name="store-maintenance", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def due(self) -> None:
        """The disk is filling: run retention at the next tick."""
        self._due.set()

    def set_guard(self, guard: RetentionGuard | None) -> None:
        """What consumer groups still need (the delivery layer supplies it)."""
        self._guard = guard

    def checkpoint(self) -> None:
        """Flush the consume queues and log, then record how far recovery may trust them."""
        with self._writer:
            dispatched = self._log.end
            lengths, kept = self._queues.lengths(), self._queues.kept()
            segments = [s for s in self._log.segments if s.end > self._checkpointed]
            queue_maps, index_files = self._queues.take_dirty(), self._index.recent()
        for segment in segments:
            segment.fsync()
        for path, mapped in queue_maps:
            flush_mapped(path, mapped)
        for index_file in index_files:
            index_file.flush()
        checkpoint.save(self._path, checkpoint.Checkpoint(dispatched, lengths, kept))
        self._checkpointed = dispatched

    def clean(self) -> list[retention.Deletion]:
        """Run retention now; returns the deleted segments."""
        needed = self._needed()
        with self._writer:
            deleted = retention.select(self._log, self._config, self._path, needed)
            if deleted:
                self._queues.drop_below(self._log.min_offset)
                self._index.drop_below(self._log.min_offset)
        return deleted

    def _needed(self) -> dict[tuple[str, int], int]:
        """The guard's queue offsets as log offsets (a queue offset below the first kept: that one)."""
        needed: dict[tuple[str, int], int] = {}
        for (topic, queue), queue_offset in (self._guard() if self._guard else {}).items():
            consume_queue = self._queues.get(topic, queue)
            if consume_queue is None:
                continue
            first = max(queue_offset, consume_queue.first_offset(self._log.min_offset))
            entry = consume_queue.get(first, 1)
            if entry:
                needed[(topic, queue)] = entry[0].log_offset
        return needed

    def _run(self) -> None:
        every = max(1, round(self._config.retention_interval / self._config.checkpoint_interval))
        ticks = 0
        while not self._stop.wait(self._config.checkpoint_interval):
            ticks += 1
            try:
                self.checkpoint()
                if self._due.is_set() or ticks % every == 0:
                    self._due.clear()
                    self.clean()
            except (BrokerError, OSError) as exc:  # keep maintaining; the next tick retries
                log.error("store.maintenance_failed", error=repr(exc))
