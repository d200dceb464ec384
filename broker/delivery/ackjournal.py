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
line (its ack was never confirmed) is ignored and cut. The journal is compacted
(`compact`) once it passes ``COMPACT_BYTES``: the offsets file is written
first, then a new journal holding only the done offsets above each committed
offset replaces the old one atomically.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import structlog

from broker.delivery.offsets import OffsetKey
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
    """Appends ack facts to one file; `synced` / `synced_async` wait for their fsync."""

    def __init__(self, path: Path, length: int) -> None:
        """Append to ``path`` after its first ``length`` bytes (its good lines: a torn tail is
        cut, or the next line would join it and be lost at the next replay)."""
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.ftruncate(self._fd, length)
        self.size = length
        self._state = threading.Condition(threading.Lock())  # the queue and the sequence numbers
        self._file = threading.Lock()  # the descriptor: one write+fsync, or a compaction, at a time
        self._queued: list[bytes] = []
        self._recorded = 0  # acks recorded so far
        self._durable = 0  # acks an fsync covers
        self._error: BaseException | None = None
        self._waiting: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="broker-ack-journal", daemon=True)
        self._thread.start()

    def record(self, key: OffsetKey, offsets: Iterable[int] | int) -> None:
        """Queue the fact that ``offsets`` of ``key`` are done, or (an int) that ``key`` was
        sought there (the engine's lock held)."""
        line = _line(key, offsets)
        with self._state:
            self._queued.append(line)
            self._recorded += 1
            self._state.notify_all()

    def synced(self) -> None:
        """Return once every ack recorded so far is fsynced (or raise why it cannot be)."""
        with self._state:
            target = self._recorded
            self._state.wait_for(lambda: self._durable >= target or self._error is not None)
            if self._durable < target:
                raise self._error or OSError("the ack journal stopped")

    async def synced_async(self) -> None:
        """`synced` for a task on an event loop: awaits the committer's fsync."""
        loop = asyncio.get_running_loop()
        with self._state:
            target = self._recorded
            if self._durable >= target:
                return
            if self._error is not None:
                raise self._error
            future: asyncio.Future[None] = loop.create_future()
            self._waiting.append((target, loop, future))
        await future

    def compact(self, acked: Acked) -> None:
        """Replace the journal by ``acked`` (every done offset above the committed ones, taken
        under the engine's lock once ``offsets.json`` holds the committed offsets)."""
        partial = self.path.with_suffix(".tmp")
        with self._file:
            with self._state:
                self._queued.clear()  # ``acked`` covers them
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
        self._settle(upto, None)

    def close(self) -> None:
        """Write and fsync what is queued, then end the thread."""
        with self._state:
            self._stopping = True
            self._state.notify_all()
        self._thread.join()
        os.close(self._fd)

    def _run(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: bool(self._queued) or self._stopping)
                lines, self._queued = self._queued, []
                upto, stopping = self._recorded, self._stopping
            if lines:
                error: BaseException | None = None
                try:
                    with self._file:
                        data = b"".join(lines)
                        os.write(self._fd, data)
                        os.fdatasync(self._fd)
                        self.size += len(data)
                except OSError as exc:  # every acker waiting hears of it; the acks stay done in memory
                    log.error("delivery.ack_journal_failed", path=str(self.path), error=str(exc))
                    error = exc
                self._settle(upto, error)
            if stopping:
                return

    def _settle(self, upto: int, error: BaseException | None) -> None:
        """Acks up to ``upto`` are durable (or failed with ``error``): wake their ackers."""
        with self._state:
            if error is None:
                self._durable = max(self._durable, upto)
            else:
                self._error = error
            ready = [w for w in self._waiting if w[0] <= self._durable or error is not None]
            self._waiting = [w for w in self._waiting if not (w[0] <= self._durable or error is not None)]
            self._state.notify_all()
        for _, loop, future in ready:
            try:
                loop.call_soon_threadsafe(_resolve, future, error)
            except RuntimeError:  # the loop closed: nobody waits there any more
                pass


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)
