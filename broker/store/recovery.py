"""Bringing a store directory back to a consistent, appendable state on open.

After a crash (the unclean-shutdown marker is present) the commit log is
validated from the checkpoint on; a torn, zero-filled or junk tail is cut to the
last good record; the consume queues are rebuilt for what lies after the
checkpoint, and so is the open key-index file (wholly if the machine itself
crashed, from its last recorded position if only the process died). A queue
found missing or behind what the checkpoint vouched for is rebuilt from the
start of the log. A bad record with valid ones after it is a hard error naming
file and offset, unless the store is configured to skip it.

Consume queues and index files are derived from the log, so damage to them is
repaired, never fatal: a queue whose files have a hole below its end, and an
index file whose size or header does not add up, are cut back when opened
(`ConsumeQueue`, `KeyIndex`); what was cut is then behind the checkpoint or
after it, and is rebuilt here like any other lost part. A lost *first* file is
found here: the log still holds what it held (`_lost_starts`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog
from crc32c import crc32c

from broker.errors import CorruptRecordError
from broker.store import codec, scan
from broker.store.checkpoint import Checkpoint, boot_id
from broker.store.commitlog import CommitLog
from broker.store.config import StoreConfig
from broker.store.consumequeue import ConsumeQueue
from broker.store.keyindex import KeyIndex, id_hash, key_hash, offset_in_id
from broker.store.queues import QueueTable
from broker.store.runs import RunTracker
from broker.store.segment import Segment

log = structlog.get_logger("broker.store")


@dataclass
class RecoveryReport:
    """What recovery found and did."""

    crashed: bool
    replayed_from: int = 0
    records_replayed: int = 0
    truncated_at: int | None = None
    skipped: list[tuple[str, int]] = field(default_factory=list)
    rebuilt_queues: list[str] = field(default_factory=list)


def recover(
    commit_log: CommitLog,
    queues: QueueTable,
    index: KeyIndex,
    checkpoint: Checkpoint | None,
    marker: str | None,
    config: StoreConfig,
) -> RecoveryReport:
    """Validate the log tail and rebuild what is behind it; see the module docstring.

    ``marker`` is the crash marker's boot id (None: the last shutdown was clean).
    """
    commit_log.check_contiguous()
    crashed = marker is not None
    same_boot = bool(marker) and marker == boot_id()
    report = RecoveryReport(crashed=crashed)
    log_min, log_end = commit_log.min_offset, commit_log.end
    dispatched = max(checkpoint.dispatched, log_min) if checkpoint else log_min
    if dispatched > log_end:
        dispatched = commit_log.locate(log_end - 1).base if log_end > log_min else log_min
    lost_queues, index_lost = _lost_starts(commit_log, queues, index, config)
    behind = _behind(queues, checkpoint) | lost_queues
    if index_lost is not None:
        index.rebuild_all(index_lost)
    report.rebuilt_queues = sorted(f"{topic}/{queue}" for topic, queue in behind)
    index_from = _keep_index(index, crashed and not same_boot, log_end, log_min)
    start = min(dispatched, index_from, log_min if behind else log_end)
    report.replayed_from = start

    def on_damage(segment: Segment, position: int, reason: str) -> int | None:
        resume = scan.next_valid(
            commit_log, segment, position, config.max_record_size, config.read_chunk
        )
        if resume is None:
            report.truncated_at = segment.base + position
            log.warning("store.tail_truncated", file=str(segment.path), position=position,
                        reason=reason, dropped_bytes=commit_log.end - report.truncated_at)
            commit_log.truncate(report.truncated_at)
            return None
        if not config.skip_corrupt:
            raise CorruptRecordError(str(segment.path), position, reason)
        report.skipped.append((str(segment.path), position))
        log.error("store.record_skipped", file=str(segment.path), position=position,
                  reason=reason, resume_at=resume)
        return resume

    frames = scan.frames(commit_log, start, config.max_record_size, config.read_chunk, on_damage)
    report.records_replayed = _replay(frames, queues, index, dispatched, index_from, behind)
    for consume_queue in queues:
        consume_queue.trim(commit_log.end)
    index.advance(commit_log.end)
    if crashed or report.truncated_at is not None or report.skipped or behind:
        log.warning("store.recovered", crashed=crashed, replayed_from=start,
                    records_replayed=report.records_replayed, truncated_at=report.truncated_at,
                    skipped=len(report.skipped), rebuilt_queues=report.rebuilt_queues,
                    log_end=commit_log.end)
    return report


def _replay(
    frames: Iterator[scan.Frame],
    queues: QueueTable,
    index: KeyIndex,
    dispatched: int,
    index_from: int,
    behind: set[tuple[str, int]],
) -> int:
    """Dispatch frames to the consume queues (from ``dispatched``) and index (from ``index_from``).

    Works on the raw frame bytes: this loop is what a full rebuild spends its time in.
    """
    consume_queues: dict[tuple[bytes, int], ConsumeQueue] = {}
    pending: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    hashes, offsets, sizes, times = pending
    replayed, prefix_size, frame_min = 0, codec.PREFIX.size, codec.FRAME_MIN
    runs = RunTracker()  # a batch run's ids after its first are found by reading on
    for log_offset, data, position, fields in frames:
        replayed += 1
        length, _, queue, queue_offset, store_time, _, tl, il, kl, gl, _, _ = fields
        size = prefix_size + length
        p = position + frame_min
        topic_b = data[p : p + tl]
        if log_offset >= dispatched or behind:
            consume_queue = consume_queues.get((topic_b, queue))
            if consume_queue is None:
                consume_queue = queues.ensure(topic_b.decode(), queue)
                consume_queues[(topic_b, queue)] = consume_queue
            if log_offset >= dispatched or (consume_queue.topic, queue) in behind:
                g = p + tl + il + kl
                consume_queue.put(queue_offset, log_offset, size,
                                  crc32c(data[g : g + gl]) if gl else 0)
        if log_offset >= index_from:
            store_ms = int(store_time * 1000)
            i = p + tl
            if kl:
                hashes.append(key_hash(topic_b, data[i + il : i + il + kl]))
                offsets.append(log_offset)
                sizes.append(size)
                times.append(store_ms)
            id_b = data[i : i + il]
            continues = runs.continues(id_b)  # every id read, so that a run is one in the log
            if (il != 24 or offset_in_id(id_b) != log_offset) and not continues:
                hashes.append(id_hash(id_b))
                offsets.append(log_offset)
                sizes.append(size)
                times.append(store_ms)
            if len(hashes) >= 8192:
                index.add_many(*pending)
                pending = ([], [], [], [])
                hashes, offsets, sizes, times = pending
    index.add_many(*pending)
    return replayed


def _lost_starts(
    commit_log: CommitLog, queues: QueueTable, index: KeyIndex, config: StoreConfig
) -> tuple[set[tuple[str, int]], str | None]:
    """Queues whose first file is lost, and why the index's first file is (None: it is not).

    Retention removes a queue's first file only when every entry in it points
    below the log's start, and an index file only when it indexes nothing at or
    above it. So a record the log still holds, of a queue offset below the
    queue's first file, or that the index would hold, before its first file
    begins, proves a lost first file. Only the log before each suspect's first
    entry is read (nothing, on the usual open).
    """
    log_min = commit_log.min_offset
    suspects = _suspect_queues(queues, log_min)
    index_begin = index.files[0].begin_log_offset if index.files else log_min
    end = max([index_begin, *(first_at for _, first_at in suspects.values())])
    lost: set[tuple[str, int]] = set()
    index_lost: str | None = None
    if end <= log_min:
        return lost, index_lost
    frames = scan.frames(commit_log, log_min, config.max_record_size, config.read_chunk, lambda *_: None)
    for log_offset, data, position, fields in frames:
        if log_offset >= end or (not suspects and (index_lost or log_offset >= index_begin)):
            break
        _, _, queue, queue_offset, _, _, tl, il, kl, _, _, _ = fields
        p = position + codec.FRAME_MIN
        # the queue's earliest record in the log answers for it
        consume_queue, _ = suspects.pop((data[p : p + tl], queue), (None, 0))
        if consume_queue is not None and queue_offset < consume_queue.min_file_offset:
            consume_queue.lost_start(queue_offset, log_offset)
            lost.add((consume_queue.topic, queue))
        if index_lost is None and log_offset < index_begin and (
            kl or offset_in_id(data[p + tl : p + tl + il]) != log_offset  # see _replay
        ):
            index_lost = (f"the log holds a record to index at log offset {log_offset}, before the "
                          f"first index file begins ({index_begin})")
    return lost, index_lost


def _suspect_queues(queues: QueueTable, log_min: int) -> dict[tuple[bytes, int], tuple[ConsumeQueue, int]]:
    """Queues, by (topic, queue), whose first file begins above queue offset 0 with an entry above
    ``log_min``; with the log offset of that entry (an earlier file lost would show before it)."""
    suspects: dict[tuple[bytes, int], tuple[ConsumeQueue, int]] = {}
    for consume_queue in queues:
        first = consume_queue.min_file_offset
        entry = consume_queue.get(first, 1) or consume_queue.get(consume_queue.first_offset(log_min), 1)
        if first and entry and entry[0].log_offset > log_min:
            suspects[(consume_queue.topic.encode(), consume_queue.queue)] = (consume_queue, entry[0].log_offset)
    return suspects


def _behind(queues: QueueTable, checkpoint: Checkpoint | None) -> set[tuple[str, int]]:
    """Queues the checkpoint knew longer than they are now (a lost or stale queue file)."""
    behind: set[tuple[str, int]] = set()
    for name, length in (checkpoint.queues if checkpoint else {}).items():
        topic, _, queue = name.rpartition("/")
        found = queues.get(topic, int(queue))
        if found is None or found.length < length:
            behind.add((topic, int(queue)))
    return behind


def _keep_index(index: KeyIndex, machine_crashed: bool, log_end: int, log_min: int) -> int:
    """Drop index files recovery cannot trust; return the log offset to re-index from."""
    for position, index_file in enumerate(index.files):
        if (machine_crashed and not index_file.sealed) or index_file.end_log_offset > log_end:
            index.drop_from(position)
            break
    return max(index.end_log_offset or log_min, log_min)
