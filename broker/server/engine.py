"""What the server drives: `Engine`, the delivery engine's `BrokerApi` run off the event loop.

The server speaks two protocols on one asyncio loop and turns every request
into one call of the engine. The engine is synchronous (`broker.delivery`),
so a call that may block (a publish waits for its fsync) runs on a thread of
the engine's own pool; a long-poll fetch waits on a thread of a second pool,
never on the loop, so however many fetches wait, acks and publishes are not
starved. A fetch that finds messages at once, an ack, and the checks of a publish
run on the loop itself when the lock of the component they need is free (they only compute,
and under the GIL a thread would not run beside the loop anyway): two thread
hand-offs fewer per batch. A publish's records are then written on the loop
as well (with those of every connection that published in the same pass of
the loop) and it awaits the fsync the store's committer thread does
meanwhile, which wakes the loop's tasks with one call. When the lock is busy
they go to the threads as well.
When a connection ends, the server calls `Engine.leave` for each of its
members, and the engine redelivers whatever they held unacknowledged.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from broker.delivery.api import BrokerApi
from broker.delivery.consume import Consuming
from broker.delivery.cursor import ByteWindow
from broker.delivery.engine import Broker
from broker.delivery.group import retry_topic
from broker.delivery.publishing import Batch, Publish, Publishing
from broker.delivery.topics import check_name
from broker.delivery.values import (
    Delivery,
    DeliveryColumns,
    MessageColumns,
    OutgoingMessage,
    Placement,
    PlacementColumns,
    joined,
)
from broker.errors import DeliveryError
from broker.protocol.operations import Operation

__all__ = ["ByteWindow", "Delivery", "DeliveryColumns", "Engine", "MessageColumns", "OutgoingMessage", "Placement",
           "PlacementColumns"]
T = TypeVar("T")


class Engine:
    """The async face of a `BrokerApi`; every call may be awaited concurrently."""

    def __init__(self, api: BrokerApi, threads: int = 32, waiting_threads: int = 64) -> None:
        self.api = api
        self._broker = api if isinstance(api, Broker) else None  # whose lock may be tried on the loop
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="broker-engine")
        self._waits = ThreadPoolExecutor(max_workers=waiting_threads, thread_name_prefix="broker-wait")
        self._windows: weakref.WeakSet[ByteWindow] = weakref.WeakSet()  # of open connections

    def unacked_bytes(self) -> int:
        """Bytes of messages the open connections hold unacknowledged (``broker_unacked_bytes``)."""
        return sum(window.held for window in list(self._windows))

    async def _run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(call, *args, **kwargs))

    async def _wait(self, call: Callable[..., T], *args: Any) -> T:
        """A call that may block for long (a long-poll fetch) on a pool of its own, so
        however many wait, publishes and acks still find a thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._waits, functools.partial(call, *args))

    def has_group(self, group: str) -> bool:
        """Whether the engine knows ``group`` already, joined since it started or before (its
        ``%RETRY%`` topic is made at its first join); an engine of another process cannot say: False."""
        return self._broker is not None and (self._broker.consuming.has_group(group)
                                             or self._broker.publishing.has_topic(retry_topic(group)))

    def state_file(self, name: str) -> Path | None:
        """The file ``name`` beside the engine's own state (an engine of another process: None)."""
        return None if self._broker is None else self._broker.path / "delivery" / name

    def has_topic(self, topic: str) -> bool:
        """Whether the engine knows ``topic`` already (an engine of another process: False)."""
        return self._broker is not None and self._broker.publishing.has_topic(topic)

    def observe_fsync(self, observer: Callable[[float], None] | None) -> None:
        """Tell ``observer`` the seconds each fsync of the store takes (an engine in this process)."""
        if self._broker is not None:
            self._broker.store.observe_fsync(observer)

    async def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        return await self._run(self.api.publish, topic, messages)

    async def publish_columns(self, topic: str, messages: MessageColumns,
                              batches: Sequence[Batch] = ()) -> PlacementColumns:
        """`publish` column by column, as the native protocol carries it (no object per message);
        ``batches``: the batch ids that name the messages (`broker.delivery.publishing`)."""
        broker = self._broker
        if broker is None:
            if batches:
                raise DeliveryError("batch ids need the broker's own engine")
            return PlacementColumns.of(await self._run(self.api.publish, topic, messages.messages()))
        check_name("topic", topic)
        publish = broker.publishing.try_begin(topic, messages, batches)
        if publish is None:  # its lock is busy, or this publish has to run on a thread
            return await self._run(broker.publish_columns, topic, messages, batches)
        # a cancelled caller (its client gone) must not stop the append half way: a resend of
        # its ids would not find them in the window
        return await asyncio.shield(self._append_here(broker.publishing, publish))

    async def _append_here(self, publishing: Publishing, publish: Publish) -> PlacementColumns:
        appended = await publishing.append_async(publish)
        placed = publishing.try_finish(publish, appended)
        return placed if placed is not None else await self._run(publishing.finish, publish, appended)

    async def join(self, group: str, topics: Sequence[str], **options: Any) -> str:
        return await self._run(self.api.join, group, topics, **options)

    async def share_window(self, member: str, window: ByteWindow) -> None:
        """``member``'s unacknowledged messages count in ``window`` (one per connection, bounded by
        ``max_unacked_bytes``): past its limit the member is handed nothing until acks free room.
        Called right after the join, before its first fetch (an engine of another process: no bound)."""
        self._windows.add(window)
        if self._broker is not None:
            await self._run(self._broker.consuming.share_window, member, window)

    async def leave(self, member: str) -> None:
        await self._run(self.api.leave, member)

    async def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        return (await self.fetch_columns(member, max_messages, timeout)).deliveries()

    async def fetch_columns(self, member: str, max_messages: int, timeout: float) -> DeliveryColumns:
        """`fetch` column by column, as the native protocol sends it (no `Delivery` per message)."""
        if self._broker is None:
            return DeliveryColumns.of(await self._wait(self.api.fetch, member, max_messages, timeout))
        consuming = self._broker.consuming
        taken = consuming.fetch(member, max_messages, 0.0, blocking=False)
        if taken is None:  # the lock is busy (a publish woke the long polls): look on the engine's pool,
            # not on the pool of long waits, which long polls may all hold while messages wait here
            taken = await self._run(consuming.fetch, member, max_messages, 0.0)
        if not taken and timeout > 0:  # nothing there: wait for it
            taken = await self._fetch_waiting(consuming, member, max_messages, timeout)
        return joined(taken or [])

    async def _fetch_waiting(self, consuming: Consuming, member: str, max_messages: int,
                             timeout: float) -> list[DeliveryColumns] | None:
        """A fetch that may wait, on the pool of long waits. If its caller is cancelled (its
        client left), the fetch stops, and what it took is given back unsent (`give_back`)."""
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()
        waiting = loop.run_in_executor(self._waits, functools.partial(
            consuming.fetch, member, max_messages, timeout, cancelled=cancelled))
        try:
            return await asyncio.shield(waiting)
        except asyncio.CancelledError:
            cancelled.set()  # the fetch returns within one idle wait
            try:
                taken = await waiting
            except Exception:  # noqa: BLE001 - the member left meanwhile: nothing was taken
                taken = None
            if taken:
                await self.give_back(joined(taken).column("receipt"))
            raise

    async def give_back(self, receipts: Sequence[str]) -> None:
        """Deliveries that never reached the client go back unmarked (`Consuming.give_back`)."""
        if self._broker is not None and receipts:
            await self._run(self._broker.consuming.give_back, receipts)

    async def ack(self, member: str, receipts: Sequence[str]) -> None:
        if self._broker is None:
            await self._run(self.api.ack, member, receipts)
            return
        consuming = self._broker.consuming
        if not consuming.ack(member, receipts, blocking=False):
            await self._run(consuming.ack, member, receipts)
        await consuming.synced_async()  # `sync`: confirmed once durable

    async def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        await self._run(self.api.nack, member, receipts, delay)

    async def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        await self._run(self.api.dead_letter, member, receipts, reason)

    async def call(self, op: Operation, args: Mapping[str, Any]) -> Any:
        """Run the table's operation ``op`` with its parsed ``args``: on the pool of long waits
        when it may wait, else on the engine's own."""
        if op.waits:
            return await self._wait(op.call, self.api, args)
        return await self._run(op.call, self.api, args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._waits.shutdown(wait=True, cancel_futures=True)
