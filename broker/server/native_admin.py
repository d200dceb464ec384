"""The native protocol's operator requests: dead-letter queues, message lookup, stats.

``reliable broker dlq list | replay | purge``, ``reliable broker message``
and ``reliable broker stats`` send these. A dead-letter queue ``%DLQ%<group>``
is the caller's only if it may consume from it; a message looked up is shown
only to a caller that may consume from its topic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.delivery.group import dlq_topic
from broker.server.errors import MalformedFrameError
from broker.server.native_ops import Context, Operation, Reply, delivery_table, need


def _group(ctx: Context, request: Mapping[str, Any], op: str) -> str:
    group = need(request, op, "group", str)
    ctx.principal.check_consume([dlq_topic(group)])
    return group


async def dlq_list(ctx: Context, request: Mapping[str, Any]) -> Reply:
    group = _group(ctx, request, "dlq_list")
    limit = need(request, "dlq_list", "limit", int, 100)
    if limit < 1:
        raise MalformedFrameError(f"dlq_list: limit {limit} must be >= 1")
    return {"messages": delivery_table(await ctx.engine.dlq_list(group, limit))}


async def dlq_waiting(ctx: Context, request: Mapping[str, Any]) -> Reply:
    return {"waiting": await ctx.engine.dlq_waiting(_group(ctx, request, "dlq_waiting"))}


async def dlq_replay(ctx: Context, request: Mapping[str, Any]) -> Reply:
    return {"replayed": await ctx.engine.dlq_replay(_group(ctx, request, "dlq_replay"))}


async def dlq_purge(ctx: Context, request: Mapping[str, Any]) -> Reply:
    return {"purged": await ctx.engine.dlq_purge(_group(ctx, request, "dlq_purge"))}


async def lookup_key(ctx: Context, request: Mapping[str, Any]) -> Reply:
    topic = need(request, "lookup_key", "topic", str)
    ctx.principal.check_consume([topic])
    found = await ctx.engine.lookup_key(
        topic, need(request, "lookup_key", "key", str),
        float(need(request, "lookup_key", "begin", (int, float), 0.0)),
        float(need(request, "lookup_key", "end", (int, float), 2.0**40)),
        need(request, "lookup_key", "limit", int, 64))
    return {"messages": delivery_table(found)}


async def lookup_id(ctx: Context, request: Mapping[str, Any]) -> Reply:
    found = await ctx.engine.lookup_id(need(request, "lookup_id", "message_id", str))
    if found is None or not ctx.principal.may_consume(found.topic):
        return {"messages": delivery_table([])}
    return {"messages": delivery_table([found])}


async def stats(ctx: Context, request: Mapping[str, Any]) -> Reply:
    topics = [t for t in await ctx.engine.topics() if not t.name.startswith("%")]
    groups = await ctx.engine.groups()
    return {"stats": {"topics": len(topics), "messages": sum(t.messages for t in topics),
                      "groups": len(groups), "members": sum(g.members for g in groups),
                      **ctx.metrics.totals()}}


OPERATIONS: dict[str, Operation] = {
    "dlq_list": dlq_list, "dlq_waiting": dlq_waiting, "dlq_replay": dlq_replay,
    "dlq_purge": dlq_purge, "lookup_key": lookup_key, "lookup_id": lookup_id, "stats": stats,
}
#: long operator requests run beside the connection's others (a progress bar polls dlq_waiting)
CONCURRENT = frozenset({"dlq_replay"})
