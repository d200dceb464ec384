"""The checkpoint, the unclean-shutdown marker and the directory lock.

The checkpoint vouches that the consume queues are on disk for every record
before ``dispatched`` (they were flushed first), and how long each queue was
then; recovery re-dispatches only what lies after it. The marker exists while
a store is open: finding it on start means the last run crashed. It names the
boot: a crash within the same boot (a killed process) left the page cache, and
so every memory-mapped consume-queue and index write, intact; after a crash of
the machine only what was flushed before the checkpoint can be trusted.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from broker.errors import CorruptStoreError, StoreLockedError
from broker.store.files import atomic_write, fsync_directory

CHECKPOINT = "checkpoint.json"
MARKER = "unclean-shutdown"
LOCK = "lock"


@dataclass(frozen=True)
class Checkpoint:
    """What the last checkpoint vouched for."""

    dispatched: int = 0
    queues: dict[str, int] = field(default_factory=dict)
    kept: dict[str, list[int]] = field(default_factory=dict)  # per queue: kept_from, kept_bytes


def queue_name(topic: str, queue: int) -> str:
    """The checkpoint key of a topic queue."""
    return f"{topic}/{queue}"


def load(directory: Path) -> Checkpoint | None:
    """The saved checkpoint, or None if there is none."""
    path = directory / CHECKPOINT
    try:
        data = json.loads(path.read_bytes())
        return Checkpoint(int(data["dispatched"]), {str(k): int(v) for k, v in data["queues"].items()},
                          {str(k): [int(v[0]), int(v[1])] for k, v in data.get("kept", {}).items()})
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptStoreError(f"checkpoint {path} is unreadable: {exc}") from exc


def save(directory: Path, checkpoint: Checkpoint) -> None:
    """Replace the checkpoint atomically and durably."""
    payload = {"dispatched": checkpoint.dispatched, "queues": checkpoint.queues, "kept": checkpoint.kept}
    atomic_write(directory / CHECKPOINT, json.dumps(payload, sort_keys=True).encode())


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the machine ("" if unknown): a crash in the same boot kept the page cache."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def crash_marker(directory: Path) -> str | None:
    """None after a clean shutdown; else the boot id the crashed run wrote ("" if unknown)."""
    try:
        return (directory / MARKER).read_text().strip()
    except FileNotFoundError:
        return None


def mark_open(directory: Path) -> None:
    """Write the unclean-shutdown marker (durably) for this run, naming this boot."""
    atomic_write(directory / MARKER, boot_id().encode())


def mark_closed(directory: Path) -> None:
    """Remove the marker: this run shut down cleanly."""
    (directory / MARKER).unlink(missing_ok=True)
    fsync_directory(directory)


def lock(directory: Path) -> int:
    """Take the directory's exclusive lock (released by the OS if the process dies)."""
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(f"store {directory} is already open in another process") from None
    return fd


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
