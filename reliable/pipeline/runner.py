"""How the one pipeline waits: inline for sync handlers, on an event loop for async ones.

The pipeline's steps are written once, as coroutines. Whatever they wait on
(a store transaction, a blocking backend call, a backoff) they ask of their
`Runner`:
* `Inline` (sync handlers): the store's sync transaction, blocking calls made
  in place, the clock's own sleep. Nothing ever suspends, so `drive` runs a
  pipeline coroutine to its end without an event loop, on the worker's
  thread (or a lane's), as the pipeline ran before it was async;
* `OnLoop` (``async def`` handlers): the store's async transaction
  (`backends.store.aio`), blocking calls (cache, leases) on a worker thread
  of the loop, sleeps that yield to the other messages in flight.

A transaction's operations are awaited through `awaited`, which takes a sync
transaction's plain values and an async one's awaitables alike.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeVar, cast

from backends.clock import Clock, pause
from backends.store.aio import AsyncSqlStore
from backends.store.base import Store

T = TypeVar("T")


class Runner(Protocol):
    """What the pipeline's steps wait on."""

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """The handler's transaction (sync `Transaction` or `AsyncSqlTransaction`)."""

    def savepoint(self, tx: Any) -> AbstractAsyncContextManager[None]:
        """A savepoint of ``tx``: an exception inside rolls back to it and propagates."""

    async def offload(self, call: Callable[[], T]) -> T:
        """``call()``, a blocking backend call, without holding up other messages in flight."""

    async def sleep(self, seconds: float) -> None:
        """Wait between in-process retries."""


async def awaited(value: Awaitable[T] | T) -> T:
    """The value of a transaction operation: awaited on an async transaction, as is on a sync one."""
    if inspect.isawaitable(value):
        return await value
    return cast(T, value)


class Inline:
    """Sync handlers: every wait happens in place on the calling thread (see `drive`)."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self.store, self.clock = store, clock

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        with self.store.transaction() as tx:
            yield tx

    @asynccontextmanager
    async def savepoint(self, tx: Any) -> AsyncIterator[None]:
        with tx.savepoint():
            yield

    async def offload(self, call: Callable[[], T]) -> T:
        return call()

    async def sleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)


def drive(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a pipeline coroutine under `Inline` to its end, without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return cast(T, finished.value)
    coroutine.close()
    raise RuntimeError("a sync pipeline awaited something that suspends; sync handlers run on Inline")


class OnLoop:
    """``async def`` handlers: many messages in flight on an event loop of the runner's own.

    The loop runs on a thread of its own; the worker hands it the messages of
    a fetch (`run`) and waits for their results, so transports stay sync. The
    store's async transactions are opened for this loop, ``connections`` at
    once (one per message in flight).
    """

    def __init__(self, store: Store, clock: Clock, connections: int, name: str) -> None:
        self.clock = clock
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"reliable-loop-{name}", daemon=True)
        self._thread.start()
        self.store: AsyncSqlStore = store.open_async(connections)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result (from the worker's thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        """Close the async store on its loop, then stop the loop."""
        try:
            self.run(self.store.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        return self.store.transaction()

    def savepoint(self, tx: Any) -> AbstractAsyncContextManager[None]:
        return cast(AbstractAsyncContextManager[None], tx.savepoint())

    async def offload(self, call: Callable[[], T]) -> T:
        return await asyncio.to_thread(call)

    async def sleep(self, seconds: float) -> None:
        await pause(self.clock, seconds)
