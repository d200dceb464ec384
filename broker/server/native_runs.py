"""The native operations whose requests, queued one after another, run as one engine call.

A session that finds several ``publish`` requests to one topic (or ``ack``
requests of one member) waiting in its inbox hands them here together: one
engine call, so one fsync covers the publishes, and each request still gets
the reply it would have got alone (see broker/PROTOCOL.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.errors import BrokerError
from broker.server.engine import MessageColumns, PlacementColumns
from broker.server.native_ops import Context, Operation, Reply, need, placements_reply, strings
from broker.server.native_tables import checked_columns

RunOperation = Callable[[Context, Sequence[Mapping[str, Any]]], Awaitable[list[Reply | Exception]]]


@dataclass(frozen=True)
class Together:
    """Consecutive requests of one operation that run as one engine call: those whose ``field``
    is the same str. ``run`` answers each request (a reply, or the error it gets alone)."""

    field: str
    run: RunOperation

    def key(self, request: Mapping[str, Any]) -> str | None:
        value = request.get(self.field)
        return value if isinstance(value, str) else None

    async def alone(self, ctx: Context, request: Mapping[str, Any]) -> Reply:
        [reply] = await self.run(ctx, [request])
        if isinstance(reply, Exception):
            raise reply
        return reply


async def publish_run(ctx: Context, requests: Sequence[Mapping[str, Any]]) -> list[Reply | Exception]:
    """Consecutive publishes to one topic, in order, as one engine call: one fsync covers them all.

    The result of each is what it would have been alone (a message id sent twice
    is a duplicate either way); when the engine refuses the whole, each runs
    alone, so only the request at fault fails.
    """
    topic = need(requests[0], "publish", "topic", str)
    batches: list[MessageColumns | Exception] = []
    for request in requests:
        try:
            batches.append(_publishing(ctx, request))
        except BrokerError as error:
            batches.append(error)
    good = [batch for batch in batches if not isinstance(batch, Exception)]
    if len(good) > 1:
        try:
            placed = await _publish(ctx, topic, MessageColumns.joined(good))
        except BrokerError:
            pass  # each alone below
        else:
            parts = iter(placed.split([batch.count for batch in good]))
            return [batch if isinstance(batch, Exception) else placements_reply(next(parts))
                    for batch in batches]
    return [batch if isinstance(batch, Exception) else await _alone(ctx, topic, batch)
            for batch in batches]


def _publishing(ctx: Context, request: Mapping[str, Any]) -> MessageColumns:
    """The messages of one publish request, checked."""
    topic = need(request, "publish", "topic", str)
    messages = checked_columns(need(request, "publish", "messages", dict), "publish: messages")
    ctx.principal.check_produce([topic])
    return messages


async def _alone(ctx: Context, topic: str, messages: MessageColumns) -> Reply | Exception:
    try:
        return placements_reply(await _publish(ctx, topic, messages))
    except BrokerError as error:
        return error


async def _publish(ctx: Context, topic: str, messages: MessageColumns) -> PlacementColumns:
    loop = asyncio.get_running_loop()
    began = loop.time()
    placed = await ctx.engine.publish_columns(topic, messages)
    ctx.metrics.publish_seconds.observe(loop.time() - began)
    duplicates = sum(placed.column("duplicate")) if placed.count else 0
    ctx.metrics.published.labels(topic).inc(placed.count - duplicates)
    ctx.metrics.bytes_in.labels(topic).inc(sum(map(len, messages.column("body"))) if messages.count else 0)
    ctx.metrics.duplicates.labels(topic).inc(duplicates)
    return placed


async def ack_run(ctx: Context, requests: Sequence[Mapping[str, Any]]) -> list[Reply | Exception]:
    """Consecutive acks of one member as one engine call (acks of stale receipts are ignored
    anyway, so together they do what they would one by one)."""
    member = ctx.member(requests[0], "ack")
    receipts: list[list[str] | Exception] = []
    for request in requests:
        try:
            receipts.append(strings(request, "ack", "receipts"))
        except BrokerError as error:
            receipts.append(error)
    await ctx.engine.ack(member, [r for named in receipts if not isinstance(named, Exception)
                                  for r in named])
    return [named if isinstance(named, Exception) else {} for named in receipts]


#: operations whose requests, queued one after another, run together
TOGETHER = {"publish": Together("topic", publish_run), "ack": Together("member", ack_run)}
OPERATIONS: dict[str, Operation] = {op: together.alone for op, together in TOGETHER.items()}
