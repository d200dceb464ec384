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
from broker.protocol.errors import MalformedFrameError
from broker.protocol.operations import OPERATIONS
from broker.protocol.tables import checked_columns
from broker.server.engine import MessageColumns, PlacementColumns
from broker.server.native_ops import Context, Reply, placements_reply
from broker.store.runs import MAX_BATCH_ID

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

    The result of each is what it would have been alone (a message id or batch id sent
    twice is a duplicate either way); when the engine refuses the whole, or the requests mix
    batch ids with ids, each runs alone, so only the request at fault fails.
    """
    named: list[str] = []  # the new topic, once per request that named it (`TopicQuota.charge`)
    try:
        return await _publish_checked(ctx, requests, named)
    finally:
        ctx.topic_quota.settle(ctx.principal, named)


async def _publish_checked(ctx: Context, requests: Sequence[Mapping[str, Any]],
                           named: list[str]) -> list[Reply | Exception]:
    topic = str(requests[0].get("topic"))  # each request's own is checked below
    checked: list[tuple[MessageColumns, str] | Exception] = []
    for request in requests:
        try:
            checked.append(_publishing(ctx, request, named))
        except BrokerError as error:
            checked.append(error)
    good = [request for request in checked if not isinstance(request, Exception)]
    if len(good) > 1 and len({bool(batch_id) for _, batch_id in good}) == 1:
        batches = [(batch_id, messages.count) for messages, batch_id in good] if good[0][1] else []
        try:
            placed = await _publish(ctx, topic, MessageColumns.joined([m for m, _ in good]), batches)
        except BrokerError:
            pass  # each alone below
        else:
            parts = iter(placed.split([messages.count for messages, _ in good]))
            return [request if isinstance(request, Exception) else placements_reply(next(parts))
                    for request in checked]
    return [request if isinstance(request, Exception) else await _alone(ctx, topic, *request)
            for request in checked]


def _publishing(ctx: Context, request: Mapping[str, Any], named: list[str]) -> tuple[MessageColumns, str]:
    """The messages of one publish request, checked, and the batch id naming them ("" if none);
    the topic, if new, is added to ``named`` (charged to the user until the run settles)."""
    topic, batch_id = _PUBLISH_TOPIC.parse("publish", request), _BATCH.parse("publish", request)
    _PUBLISH.access.check(ctx.principal, {"topic": topic})
    named += ctx.topic_quota.charge(ctx.principal, [topic])
    if not _MESSAGES.kind.check(request.get("messages")):
        _MESSAGES.parse("publish", request)  # the error naming the field
    messages = checked_columns(request["messages"], "publish: messages")  # no object per message
    if len(batch_id) > MAX_BATCH_ID or (batch_id and any(messages.column("message_id"))):
        raise MalformedFrameError(f"publish: batch must be at most {MAX_BATCH_ID} characters, and "
                                  "it names the messages itself (no message_id)")
    return messages, batch_id


async def _alone(ctx: Context, topic: str, messages: MessageColumns, batch_id: str) -> Reply | Exception:
    try:
        return placements_reply(await _publish(ctx, topic, messages,
                                               [(batch_id, messages.count)] if batch_id else []))
    except BrokerError as error:
        return error


async def _publish(ctx: Context, topic: str, messages: MessageColumns,
                   batches: Sequence[tuple[str, int]]) -> PlacementColumns:
    loop = asyncio.get_running_loop()
    began = loop.time()
    placed = await ctx.engine.publish_columns(topic, messages, batches)
    ctx.metrics.publish_seconds.observe(loop.time() - began)
    duplicates = sum(placed.column("duplicate")) if placed.count else 0
    ctx.metrics.published.labels(topic).inc(placed.count - duplicates)
    ctx.metrics.bytes_in.labels(topic).inc(sum(map(len, messages.column("body"))) if messages.count else 0)
    ctx.metrics.duplicates.labels(topic).inc(duplicates)
    return placed


async def ack_run(ctx: Context, requests: Sequence[Mapping[str, Any]]) -> list[Reply | Exception]:
    """Consecutive acks of one member as one engine call (acks of stale receipts are ignored
    anyway, so together they do what they would one by one)."""
    member = ctx.member(_ACK_MEMBER.parse("ack", requests[0]), "ack")  # the run's, by the session
    receipts: list[list[str] | Exception] = []
    for request in requests:
        try:
            receipts.append(_RECEIPTS.parse("ack", request))
        except BrokerError as error:
            receipts.append(error)
    await ctx.engine.ack(member, [r for named in receipts if not isinstance(named, Exception)
                                  for r in named])
    return [named if isinstance(named, Exception) else {} for named in receipts]


#: operations whose requests, queued one after another, run together
TOGETHER = {"publish": Together("topic", publish_run), "ack": Together("member", ack_run)}
_PUBLISH = OPERATIONS["publish"]
_PUBLISH_TOPIC, _MESSAGES, _BATCH = _PUBLISH.fields
_ACK_MEMBER, _RECEIPTS = OPERATIONS["ack"].fields
