"""A small real disk for full-disk tests: a tmpfs the test mounts (root is needed), then fills.

``small_disk`` (the fixture, in ``tests/conftest.py``) mounts a `SIZE` tmpfs
under the test's ``tmp_path``; `fill` writes a ballast file until the kernel
answers ENOSPC, and says so, so a test can show the disk really was full.
``small_postgres`` mounts one owned by the PostgreSQL server's OS user and
makes a database whose tablespace is on it (`postgres_on`).
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from reliable.testing import FakeClock

SIZE = 24 * 1024 * 1024


class Ballast:
    """The file taking every free byte of a disk; ``free()`` gives the space back."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        self.error = error  # what the last write was answered: ENOSPC, when the disk is full

    @property
    def hit_enospc(self) -> bool:
        return self.error.errno == errno.ENOSPC

    def leave(self, room: int) -> None:
        """Give back ``room`` bytes: small writes succeed again, large ones do not."""
        os.truncate(self.path, self.path.stat().st_size - room)

    def free(self) -> None:
        self.path.unlink(missing_ok=True)


def fill(disk: Path, name: str = "ballast") -> Ballast:
    """A ballast file taking every free byte of ``disk``."""
    ballast = disk / name
    error = OSError(0, "the disk never filled")
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (64 * 1024, 4096, 1):  # the last bytes in smaller and smaller pieces
            try:
                while os.write(fd, b"\xab" * chunk):
                    pass
            except OSError as exc:
                error = exc
    finally:
        os.close(fd)
    return Ballast(ballast, error)


class SpaceComesBack(FakeClock):
    """A fake clock on which the ballast of `fill` is deleted once ``outage`` seconds have passed
    on it since the fill: a full disk that an operator clears."""

    def __init__(self, outage: float = 60.0) -> None:
        super().__init__()
        self.outage = outage
        self.ballast: Ballast | None = None
        self.filled_at = 0.0

    def fill(self, disk: Path) -> None:
        self.ballast, self.filled_at = fill(disk), self.time()

    @property
    def full(self) -> bool:
        return self.ballast is not None and self.ballast.path.exists()

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.full and self.time() - self.filled_at >= self.outage:
            assert self.ballast is not None
            self.ballast.free()


@contextmanager
def mounted(mount: Path, size: int = SIZE, owner: str | None = None) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``mount`` (its root owned by the OS user ``owner``, private to
    it, when given); raises `PermissionError` with the reason when it cannot be mounted."""
    mount.mkdir(exist_ok=True)
    options = f"size={size}"
    if owner is not None:
        user = pwd.getpwnam(owner)
        options += f",uid={user.pw_uid},gid={user.pw_gid},mode=0700"
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs (root is needed): {made.stderr.strip()}")
    unmount = True
    try:
        yield mount
    except StillInUse:
        unmount = False  # see StillInUse
        raise
    finally:
        if unmount:
            subprocess.run(["umount", "-l", str(mount)], check=True)


class StillInUse(Exception):
    """PostgreSQL could not drop a database or tablespace on the disk: the disk stays mounted, or
    every checkpoint of the server would fail on the files gone from under it."""


@dataclass(frozen=True)
class SmallDatabase:
    """A PostgreSQL database whose every table lives on ``disk``, a small tmpfs."""

    url: str
    disk: Path


def server_user(admin: Engine) -> str:
    """The OS user the (local) PostgreSQL server runs as: the owner of its data directory.
    `PermissionError` when the server is not on this machine (its tablespace could not be)."""
    with admin.connect() as connection:
        data_directory = connection.execute(text("show data_directory")).scalar_one()
    try:
        return pwd.getpwuid(os.stat(data_directory).st_uid).pw_name
    except OSError as exc:
        raise PermissionError(f"PostgreSQL's data directory is not on this machine ({exc}): "
                              "a tablespace on a small local disk needs a local server") from exc


@contextmanager
def postgres_on(disk: Path, admin: Engine, name: str) -> Iterator[str]:
    """A database ``name`` whose default tablespace (named ``name`` too) is on ``disk``: the tables
    created in it, their indexes and TOAST land there; the WAL stays in the server's data
    directory. Yields the database's URL; drops both afterwards, whatever happened.

    The database is copied from its template file by file (``STRATEGY file_copy``, with a
    checkpoint): PostgreSQL 15's default copies it through shared buffers, whose pages reach the
    disk only at the next checkpoint, and once the disk is full every checkpoint of the server
    fails on them ("could not write block 0": DROP DATABASE, of any test, fails with it).
    """
    location = disk / "tablespace"
    location.mkdir()
    owner = disk.stat()
    os.chown(location, owner.st_uid, owner.st_gid)  # PostgreSQL wants its location its own
    with admin.connect() as connection:
        connection.execute(text(f"create tablespace {name} location '{location}'"))
        try:
            connection.execute(text(f"create database {name} tablespace {name} strategy file_copy"))
            try:
                yield admin.url.set(database=name).render_as_string(hide_password=False)
            finally:
                _clear(disk, keep=location)  # what a failed test left: the drop's checkpoint needs room
                _drop(connection, f"drop database if exists {name} with (force)")
        finally:
            _drop(connection, f"drop tablespace if exists {name}")


def _clear(disk: Path, keep: Path) -> None:
    for entry in disk.iterdir():
        if entry.is_dir() and entry != keep:
            shutil.rmtree(entry)
        elif entry != keep:
            entry.unlink()


def _drop(connection: Connection, statement: str) -> None:
    try:
        connection.execute(text(statement))
    except DBAPIError as exc:
        raise StillInUse(f"{statement}: {exc.orig}") from exc
