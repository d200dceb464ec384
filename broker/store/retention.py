"""Retention: which whole segments to delete, oldest first.

A segment goes when its newest record is older than the retention time, or
when the disk is filling: at ``clean_at`` only segments no consumer group still
needs; at ``force_at``, if set (off by default), even those. Deleting what a
group still needs is logged as a warning naming the queues that lose messages.
Appends are refused at ``refuse_at`` (see `MessageStore.append`), so by default
a disk filled by messages groups still need stops producers, never loses those
messages. The active segment is never deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from broker.store import codec
from broker.store.commitlog import CommitLog
from broker.store.config import StoreConfig
from broker.store.segment import Segment

log = structlog.get_logger("broker.store")

Needed = Mapping[tuple[str, int], int]
"""Per (topic, queue): the lowest log offset a consumer group still needs."""


@dataclass(frozen=True)
class Deletion:
    """One deleted segment and why."""

    path: str
    reason: str


def newest_time(following: Segment) -> float | None:
    """An upper bound of a segment's newest store time: the next segment's first record's."""
    data = following.read(0, codec.FRAME_MIN)
    if len(data) < codec.FRAME_MIN:
        return None
    magic, _ = codec.PREFIX.unpack_from(data, 0)
    return codec.HEADER.unpack_from(data, codec.PREFIX.size)[4] if magic == codec.MAGIC else None


def select(commit_log: CommitLog, config: StoreConfig, directory: Path, needed: Needed) -> list[Deletion]:
    """Delete the segments retention calls for (the caller holds the writer lock)."""
    deleted: list[Deletion] = []
    now = config.clock.time()
    while len(commit_log.segments) > 1:
        oldest, following = commit_log.segments[0], commit_log.segments[1]
        usage = config.disk_usage(directory)
        newest = newest_time(following)
        losing = sorted(f"{t}/{q}" for (t, q), offset in needed.items() if offset < oldest.end)
        if config.retention and newest is not None and now - newest > config.retention:
            reason = "expired"
        elif config.force_at is not None and usage >= config.force_at:
            reason = "disk_force"
        elif usage >= config.clean_at and not losing:
            reason = "disk_clean"
        else:
            break
        commit_log.delete_oldest()
        deleted.append(Deletion(str(oldest.path), reason))
        log.info("store.segment_deleted", file=str(oldest.path), reason=reason,
                 disk_usage=round(usage, 4))
        if losing:
            log.warning("store.needed_messages_deleted", file=str(oldest.path), reason=reason,
                        queues=losing)
    return deleted
