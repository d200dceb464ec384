"""`AckJournal`: under ``flush = "sync"``, an acknowledgement is durable before it is confirmed.

Group offsets reach ``offsets.json`` only every ``offset_flush_interval``, so
after a crash the acks of the last interval would be delivered again. The
journal closes that window: each ack appends one line ``[group, topic, queue,
[offsets]]`` (a fact: these offsets are done) to ``acks.journal``, and the
acker is answered only once an fsync covers it. One committer thread writes
and fsyncs what every acker queued since its last pass, so concurrent acks
share an fsync (the same group commit as `broker.store.groupcommit` gives the
appends, on its own file: an ack appends no record to the log).

At start the journal is replayed over ``offsets.json`` (`replay`): a fact is
idempotent, so an old one over newer offsets changes nothing, and a torn last
line (its ack was never confirmed) is ignored and cut. A write a full disk
refuses is cut back to the last whole line and tried again at the next pass
(its ackers hear of the refusal); any other failed write fails every later
ack until the broker is reopened. The journal is compacted
(`compact`) once it passes ``COMPACT_BYTES``: the offsets file is written
first, then a new journal holding only the done offsets above each committed
offset replaces the old one atomically.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import structlog

from broker.delivery.offsets import OffsetKey
from broker.store import MessageStore
from broker.store.files import fsync_directory

log = structlog.get_logger("broker.delivery")
COMPACT_BYTES = 4 * 1024 * 1024
"""Journal size past which `Broker.save_offsets` compacts it."""
Acked = dict[OffsetKey, set[int]]
"""Offsets done per (group, topic, queue), as the journal recorded them."""


class Replayed(NamedTuple):
    """What a journal held: the offsets done per key, where a key was last sought (what was done
    before is forgotten), and the length of its good lines (what follows was torn)."""

    acked: Acked
    sought: dict[OffsetKey, int]
    length: int


def replay(path: Path) -> Replayed:
    """The facts of the journal at ``path``, up to its first torn or unreadable line."""
    replayed = Replayed({}, {}, 0)
    if not path.exists():
        return replayed
    data = path.read_bytes()
    length = 0
    for number, line in enumerate(data.split(b"\n")[:-1], 1):  # the last piece has no newline: torn
        try:
            group, topic, queue, offsets = json.loads(line)
            key = (str(group), str(topic), int(queue))
            if isinstance(offsets, int):
                replayed.sought[key] = offsets
                replayed.acked[key] = set()
            else:
                replayed.acked.setdefault(key, set()).update(map(int, offsets))
        except (ValueError, TypeError) as exc:
            log.warning("delivery.ack_journal_torn", path=str(path), line=number, error=str(exc))
            break
        length += len(line) + 1
    if length < len(data):
        log.warning("delivery.ack_journal_cut", path=str(path), kept=length, dropped=len(data) - length)
    return replayed._replace(length=length)


def _line(key: OffsetKey, offsets: Iterable[int] | int) -> bytes:
    fact = offsets if isinstance(offsets, int) else sorted(offsets)
    return json.dumps([*key, fact], separators=(",", ":")).encode() + b"\n"


class AckJournal:
    """Appends ack facts to one file, written and fsynced by the store's group commit;
    `synced` / `synced_async` wait for the committer's pass that covers them."""

    def __init__(self, path: Path, length: int, store: MessageStore) -> None:
        """Append to ``path`` after its first ``length`` bytes (its good lines: a torn tail is
        cut, or the next line would join it and be lost at the next replay); ride the group
        commit of ``store`` (which must be ``sync``)."""
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.ftruncate(self._fd, length)
        self.size = length
        self._store = store
        self._queued: list[bytes] = []  # lines recorded, not yet written
        self._recorded = 0  # lines recorded so far
        self._durable = 0  # lines an fsync (or a compaction) covers
        self._error: OSError | None = None  # a failed write: what was queued then may be lost
        self._state = threading.Lock()  # the queue
        self._file = threading.Lock()  # the descriptor: one write+fsync, or a compaction, at a time
        store.attach_journal(self)

    def record(self, key: OffsetKey, offsets: Iterable[int] | int) -> None:
        """Queue the fact that ``offsets`` of ``key`` are done, or (an int) that ``key`` was
        sought there (the engine's lock held)."""
        line = _line(key, offsets)
        with self._state:
            self._queued.append(line)
            self._recorded += 1

    def synced(self) -> None:
        """Return once every ack recorded so far is fsynced (or raise why it cannot be)."""
        if self._durable < self._recorded:  # else nothing to wait for: no pass of the committer
            self._store.journal_synced()

    async def synced_async(self) -> None:
        """`synced` for a task on an event loop: awaits the committer's fsync."""
        if self._durable < self._recorded:
            await self._store.journal_synced_async()

    def commit(self) -> None:
        """Write and fsync the lines queued so far (the store's committer thread)."""
        with self._state:
            lines, self._queued = self._queued, []
            upto = self._recorded
        if self._error is not None:
            raise self._error
        if not lines:
            return
        with self._file:
            data = b"".join(lines)
            try:
                written = 0
                while written < len(data):  # a nearly full disk takes part of a write
                    written += os.write(self._fd, data[written:])
                os.fdatasync(self._fd)
            except OSError as exc:
                log.error("delivery.ack_journal_failed", path=str(self.path), error=str(exc))
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._cut_back():
                    with self._state:  # this pass's ackers hear of it; the next pass writes the lines
                        self._queued[:0] = lines
                else:  # every acker from now on hears of it; the acks stay done in memory
                    self._error = exc
                raise
            self.size += len(data)
            self._durable = max(self._durable, upto)

    def _cut_back(self) -> bool:
        """Cut a write the disk refused back to the last whole line (a later line must not join a
        torn one); False if even that fails."""
        try:
            os.ftruncate(self._fd, self.size)
        except OSError:
            return False
        return True

    def compact(self, acked: Acked) -> None:
        """Replace the journal by ``acked`` (every done offset above the committed ones, taken
        under the engine's lock once ``offsets.json`` holds the committed offsets)."""
        partial = self.path.with_suffix(".tmp")
        with self._file:
            with self._state:
                self._queued.clear()  # ``acked`` covers them, fsynced before their ackers are woken
                upto = self._recorded
            with open(partial, "wb") as out:
                out.write(b"".join(_line(key, offsets) for key, offsets in sorted(acked.items()) if offsets))
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, self.path)
            fsync_directory(self.path.parent)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self.size = os.fstat(self._fd).st_size
            self._durable = max(self._durable, upto)

    def close(self) -> None:
        """Close the file (after the store: its last committer pass writes what is queued)."""
        with self._file:
            os.close(self._fd)


