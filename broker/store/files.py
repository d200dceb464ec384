"""Small durable-file helpers shared by the store's modules."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path


def fsync_directory(path: Path) -> None:
    """Make the creation, renaming or removal of entries in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    fsync_directory(path.parent)


def flush_mapped(path: Path, mapped: mmap.mmap) -> None:
    """Force the changes made through ``mapped`` (a map of ``path``) to disk.

    On Linux ``msync(MS_SYNC)`` is an fsync of the file, so the file is fsynced
    instead: ``os.fsync`` lets other threads run meanwhile, ``mmap.flush()``
    holds the GIL for the whole write-back (tens of milliseconds every
    checkpoint, during which no producer could run). A file retention has just
    deleted needs no flush.
    """
    if sys.platform != "linux":
        mapped.flush()
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
