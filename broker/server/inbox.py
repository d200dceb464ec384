"""`Inbox`: the requests of one native connection read but not yet run, in the order they came.

The session reads frames into its inbox while earlier requests run, so a
client that pipelines keeps the socket busy during an fsync, and requests that
queued up meanwhile can run together (`take_run`): several publishes to one
topic share one engine call and one fsync, several acks of one member one
engine call. The inbox holds ``limit`` bytes of frames (one frame more at
most); past that the reader waits, and the client feels the back-pressure of
its socket.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class Pending:
    """One request read from the wire: decoded, or the error its frame gave."""

    request_id: int
    request: Mapping[str, Any]
    size: int
    error: Exception | None = None

    @property
    def op(self) -> str | None:
        op = self.request.get("op")
        return op if self.error is None and isinstance(op, str) else None


class Inbox:
    """A bounded queue of `Pending` requests between a session's reader and its runner."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queued: deque[Pending] = deque()
        self._bytes = 0
        self._unfinished = 0  # taken or queued, and not yet `finished`
        self._closed = False
        self._changed = asyncio.Event()

    @property
    def idle(self) -> bool:
        """Whether every request put in has run."""
        return self._unfinished == 0

    def put(self, pending: Pending) -> None:
        self._queued.append(pending)
        self._bytes += pending.size
        self._unfinished += 1
        self._changed.set()

    def finished(self, count: int = 1) -> None:
        """``count`` requests taken have run."""
        self._unfinished -= count
        self._changed.set()

    async def settled(self) -> None:
        """Return once every request put in has run."""
        while not self.idle:
            await self._wait()

    def close(self) -> None:
        """No more requests come (the client closed its side): `take` ends once the inbox is empty."""
        self._closed = True
        self._changed.set()

    async def room(self) -> None:
        """Return once the inbox holds less than ``limit`` bytes."""
        while self._bytes >= self.limit:
            await self._wait()

    async def take(self) -> Pending | None:
        """The oldest request, waiting for one; None once closed and empty."""
        while not self._queued:
            if self._closed:
                return None
            await self._wait()
        return self._pop()

    def take_run(self, joins: Callable[[Pending], bool]) -> list[Pending]:
        """The requests at the head of the inbox that ``joins`` accepts, up to the first it does not."""
        run = []
        while self._queued and joins(self._queued[0]):
            run.append(self._pop())
        return run

    def _pop(self) -> Pending:
        pending = self._queued.popleft()
        self._bytes -= pending.size
        self._changed.set()
        return pending

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()
