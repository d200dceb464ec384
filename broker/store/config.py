"""`StoreConfig`: every knob of the message store, validated when it is built."""

from __future__ import annotations

import enum
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker.errors import BrokerConfigError
from broker.store.clock import SYSTEM_CLOCK, Clock

DiskUsage = Callable[[Path], float]
"""Returns the used fraction (0.0–1.0) of the filesystem holding a path."""


def filesystem_usage(path: Path) -> float:
    """The real disk usage of the filesystem holding ``path``."""
    usage = shutil.disk_usage(path)
    return usage.used / usage.total if usage.total else 0.0


class FlushPolicy(str, enum.Enum):
    """When appended records are forced to disk (fsync)."""

    SYNC = "sync"  # the append returns after the fsync that covers it (group commit)
    ASYNC = "async"  # a flusher fsyncs every `flush_interval` seconds or `flush_bytes` bytes
    NONE = "none"  # the operating system decides; only checkpoints fsync


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one `MessageStore`; invalid values raise `BrokerConfigError` at once."""

    flush: FlushPolicy = FlushPolicy.ASYNC
    segment_size: int = 128 * 1024 * 1024
    max_record_size: int = 4 * 1024 * 1024
    flush_interval: float = 0.05
    flush_bytes: int = 4 * 1024 * 1024
    group_commit_wait: float = 0.005
    checkpoint_interval: float = 1.0
    queue_file_entries: int = 300_000
    index_slots: int = 65_536
    index_entries: int = 200_000
    retention: float = 72 * 3600.0
    retention_interval: float = 10.0
    clean_at: float = 0.75
    force_at: float | None = None  # off: what a group still needs is kept, appends refused instead
    refuse_at: float = 0.90
    skip_corrupt: bool = False
    read_chunk: int = 1024 * 1024
    recent_bytes: int = 64 * 1024 * 1024  # memory for the latest appends, handed to readers that keep up
    clock: Clock = SYSTEM_CLOCK
    disk_usage: DiskUsage = field(default=filesystem_usage)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flush", _flush_policy(self.flush))
        _at_least("segment_size", self.segment_size, 4096)
        _at_least("max_record_size", self.max_record_size, 256)
        if self.max_record_size > self.segment_size:
            raise BrokerConfigError(
                f"max_record_size={self.max_record_size} is larger than "
                f"segment_size={self.segment_size}; a record must fit in one segment"
            )
        _at_least("flush_bytes", self.flush_bytes, 1)
        _at_least("queue_file_entries", self.queue_file_entries, 1)
        _at_least("index_slots", self.index_slots, 1)
        _at_least("index_entries", self.index_entries, 2)
        _at_least("read_chunk", self.read_chunk, 4096)
        _at_least("recent_bytes", self.recent_bytes, 0)
        for name in ("flush_interval", "group_commit_wait", "checkpoint_interval", "retention",
                     "retention_interval"):
            if getattr(self, name) < 0:
                raise BrokerConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        force = self.refuse_at if self.force_at is None else self.force_at
        if not 0 < self.clean_at <= force <= self.refuse_at <= 1:
            raise BrokerConfigError(
                f"disk thresholds clean_at={self.clean_at}, force_at={self.force_at}, "
                f"refuse_at={self.refuse_at} must satisfy 0 < clean <= force <= refuse <= 1 "
                f"(force_at may be None: never delete what a group still needs)"
            )


def _flush_policy(value: object) -> FlushPolicy:
    try:
        return FlushPolicy(value)
    except ValueError:
        allowed = ", ".join(policy.value for policy in FlushPolicy)
        raise BrokerConfigError(f"flush={value!r} is not one of: {allowed}") from None


def _at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise BrokerConfigError(f"{name}={value!r} must be an integer >= {minimum}")
