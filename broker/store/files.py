"""Small durable-file helpers shared by the store's modules."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import structlog

log = structlog.get_logger("broker.store")

NAME_DIGITS = 20
"""A store file is named by the offset it begins at, in this many digits, then its suffix."""


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
        written = 0
        while written < len(data):  # a nearly full disk takes part of a write; the rest raises ENOSPC
            written += os.write(fd, data[written:])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(temporary, path)
    fsync_directory(path.parent)


RESERVE_CHUNK = 64 * 1024
"""Bytes a mapped file is allocated ahead of its writes (`reserve`)."""


def reserve(path: Path, length: int) -> None:
    """Allocate the blocks of ``path``'s first ``length`` bytes before they are written through a map.

    A store file written through ``mmap`` is sparse: on a full disk the write of a
    page with no block behind it is a SIGBUS, which kills the process. Allocated
    ahead, a full disk is an `OSError` (ENOSPC) here instead, before anything of
    the write happened, and the store can refuse the append and go on.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, length)
    finally:
        os.close(fd)


def allocated(path: Path) -> int:
    """How many bytes from the start of ``path`` have blocks behind them (`reserve` allocates from
    the start); past them the file is a hole, which reads as zeros.

    A file's hole must not be read through a shared map: on tmpfs that read allocates the page,
    and on a full disk it is a SIGBUS. Where holes cannot be found, the whole file counts.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not hasattr(os, "SEEK_HOLE"):
            return size
        try:
            return min(size, os.lseek(fd, 0, os.SEEK_HOLE))
        except OSError:
            return size
    finally:
        os.close(fd)


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


def numbered_files(directory: Path, suffix: str) -> dict[int, Path]:
    """The store's files in ``directory`` with ``suffix``, by the offset their names give.

    A file with the suffix but another name (``notes.cq``, ``16.cq``) is not the
    store's: it is never read as one, nor deleted, only named in a warning
    (`store.stray_file_ignored`). What the files are derived from (the commit log)
    rebuilds whatever such a file would have held.
    """
    found: dict[int, Path] = {}
    for path in sorted(directory.glob("*" + suffix)):
        offset = named_offset(path, suffix)
        if offset is not None:
            found[offset] = path
        else:
            log.warning("store.stray_file_ignored", file=str(path),
                        expected=f"{NAME_DIGITS} digits (the offset it begins at) then {suffix}")
    return found


def named_offset(path: Path, suffix: str) -> int | None:
    """The offset a store file's name gives (None: ``path`` is not named as the store names files)."""
    digits = path.name[: -len(suffix)] if path.name.endswith(suffix) else ""
    return int(digits) if len(digits) == NAME_DIGITS and digits.isascii() and digits.isdigit() else None
