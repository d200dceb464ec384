"""A small real disk for full-disk tests: a tmpfs the test mounts (root is needed), then fills.

``small_disk`` (the fixture, in ``tests/conftest.py``) mounts a `SIZE` tmpfs
under the test's ``tmp_path``; `fill` writes a ballast file until the kernel
answers ENOSPC, and says so, so a test can show the disk really was full.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


@contextmanager
def mounted(mount: Path, size: int = SIZE) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``mount``; raises `PermissionError` with the reason when it
    cannot be mounted."""
    mount.mkdir(exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs (root is needed): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
