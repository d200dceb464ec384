"""A few slots shared fairly by keys: whoever waits is served one key at a time, in turn.

The password checks of the broker server take one slot each. A client that
opens hundreds of connections at once queues them under its own key (its
address), so a client from another address waits for one check per address
ahead of it, not for the whole flood. Only waiting callers are kept, so the
memory is bounded by the connections the server holds.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Turns:
    """``slots`` holders at once; the waiting are served key by key, round robin (one event loop)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free = slots
        self.waiting = 0  # callers waiting for a slot
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def busy(self) -> int:
        """The slots held now."""
        return self.slots - self._free

    @asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``async with``, after the callers of other keys
        waiting before this one had theirs."""
        await self._take(key)
        try:
            yield
        finally:
            self._give()

    async def _take(self, key: str) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            return
        handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(handed)
        self.waiting += 1
        try:
            await handed
        except asyncio.CancelledError:
            if handed.done() and not handed.cancelled():  # the slot came with the cancellation
                self._give()
            else:
                self._forget(key, handed)
            raise

    def _give(self) -> None:
        """Hand the freed slot to the first waiting caller of the next key in turn."""
        while self._waiting:
            key, queue = self._waiting.popitem(last=False)
            handed = queue.popleft()
            self.waiting -= 1
            if queue:
                self._waiting[key] = queue  # the key's next caller waits for the others' turn
            if not handed.done():
                handed.set_result(None)
                return
        self._free += 1

    def _forget(self, key: str, handed: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key)
        if queue is not None and handed in queue:
            queue.remove(handed)
            self.waiting -= 1
            if not queue:
                del self._waiting[key]
