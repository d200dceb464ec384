"""`AsyncClient`: the broker client for asyncio programs.

The same calls as `broker.client.Client`, awaited. Each call runs the
pipelined client's request on a worker thread, so a long-poll fetch never
blocks the event loop and many coroutines share one connection.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from broker.client import Client
from broker.delivery.values import (
    Delivery,
    GroupInfo,
    OutgoingMessage,
    Placement,
    QueueLag,
    TopicInfo,
)


class AsyncClient:
    """``await client.publish(...)``, ``await client.fetch(...)``: see `Client`."""

    def __init__(self, address: str, **options: Any) -> None:
        self.sync = Client(address, **options)

    async def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(functools.partial(getattr(self.sync, method), *args, **kwargs))

    async def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        return await self._run("publish", topic, messages)  # type: ignore[no-any-return]

    async def join(self, group: str, topics: Sequence[str], **options: Any) -> str:
        return await self._run("join", group, topics, **options)  # type: ignore[no-any-return]

    async def leave(self, member: str) -> None:
        await self._run("leave", member)

    async def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        return await self._run("fetch", member, max_messages, timeout)  # type: ignore[no-any-return]

    async def ack(self, member: str, receipts: Sequence[str]) -> None:
        await self._run("ack", member, receipts)

    async def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        await self._run("nack", member, receipts, delay)

    async def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        await self._run("dead_letter", member, receipts, reason)

    async def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        await self._run("commit", member, offsets)

    async def topics(self) -> list[TopicInfo]:
        return await self._run("topics")  # type: ignore[no-any-return]

    async def groups(self) -> list[GroupInfo]:
        return await self._run("groups")  # type: ignore[no-any-return]

    async def lag(self, group: str) -> list[QueueLag]:
        return await self._run("lag", group)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)
