"""The native protocol's operations: each turns one request map into engine calls and a reply map.

Requests are validated here, field by field, with errors naming the
operation, the field and what was expected (see broker/PROTOCOL.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.delivery.values import DELIVERY_FIELDS
from broker.errors import UnknownMemberError
from broker.server.auth import Principal
from broker.server.engine import Delivery, DeliveryColumns, Engine, PlacementColumns
from broker.server.errors import MalformedFrameError
from broker.server.metrics import ServerMetrics
from broker.server.native_tables import (
    Table,
    checked_messages,
    column_table,
    table,
)

Reply = dict[str, Any]


@dataclass
class Context:
    """What an operation may use: the engine, the caller, the members this connection joined."""

    engine: Engine
    principal: Principal
    metrics: ServerMetrics
    max_fetch_wait: float
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def member(self, request: Mapping[str, Any], op: str) -> str:
        member = need(request, op, "member", str)
        if member not in self.members:  # it left, or joined on a connection that ended
            raise UnknownMemberError(f"{op}: member {member!r} was not joined on this connection")
        return member


def need(request: Mapping[str, Any], op: str, name: str, kind: type | tuple[type, ...],
         default: Any = ...) -> Any:
    """``request[name]`` if it has type ``kind``; `MalformedFrameError` naming op and field if not."""
    if name not in request:
        if default is ...:
            raise MalformedFrameError(f"{op}: field {name!r} is required")
        return default
    value = request[name]
    if isinstance(value, bool) and kind is not bool and bool not in _kinds(kind):
        raise MalformedFrameError(f"{op}: field {name!r} must be {_names(kind)}, got bool")
    if not isinstance(value, kind):
        raise MalformedFrameError(
            f"{op}: field {name!r} must be {_names(kind)}, got {type(value).__name__}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _kinds(kind))


def strings(request: Mapping[str, Any], op: str, name: str) -> list[str]:
    values = need(request, op, name, list)
    if not set(map(type, values)) <= {str}:  # checked in C: an ack names hundreds
        raise MalformedFrameError(f"{op}: field {name!r} must be a list of str")
    return values


def delivery_table(deliveries: Sequence[Delivery]) -> Table:
    return table(deliveries, DELIVERY_FIELDS)


def columns_table(taken: DeliveryColumns) -> Table:
    return column_table(taken.count, taken.same, taken.columns)


def placements_reply(placed: PlacementColumns) -> Reply:
    return {"placements": column_table(placed.count, placed.same, placed.columns)}


async def publish_to_group(ctx: Context, request: Mapping[str, Any]) -> Reply:
    group = need(request, "publish_to_group", "group", str)
    topic = need(request, "publish_to_group", "topic", str)
    messages = checked_messages(need(request, "publish_to_group", "messages", dict),
                                "publish_to_group: messages")
    ctx.principal.check_produce([topic])
    ctx.principal.check_consume([topic])  # a replay reaches the group's consumers
    return placements_reply(PlacementColumns.of(await ctx.engine.publish_to_group(group, topic, messages)))


async def subscribe(ctx: Context, request: Mapping[str, Any]) -> Reply:
    group = need(request, "subscribe", "group", str)
    topics = strings(request, "subscribe", "topics")
    if not group or not topics:
        raise MalformedFrameError("subscribe: group and topics must not be empty")
    ctx.principal.check_consume(topics)
    prefetch = need(request, "subscribe", "prefetch", int, None)
    lease = need(request, "subscribe", "lease", (int, float), None)
    tags = strings(request, "subscribe", "tags") if request.get("tags") is not None else None
    if (prefetch is not None and prefetch < 1) or (lease is not None and lease <= 0):
        raise MalformedFrameError(f"subscribe: prefetch {prefetch} must be >= 1, lease {lease} > 0")
    member = await ctx.engine.join(group, topics,
                                   broadcast=need(request, "subscribe", "broadcast", bool, False),
                                   from_end=need(request, "subscribe", "from_end", bool, False),
                                   prefetch=prefetch, lease=None if lease is None else float(lease),
                                   tags=tags)
    ctx.members[member] = tuple(topics)
    return {"member": member}


async def unsubscribe(ctx: Context, request: Mapping[str, Any]) -> Reply:
    member = ctx.member(request, "unsubscribe")
    del ctx.members[member]
    await ctx.engine.leave(member)
    return {}


async def fetch(ctx: Context, request: Mapping[str, Any]) -> Reply:
    member = ctx.member(request, "fetch")
    count = need(request, "fetch", "max_messages", int, 100)
    timeout = need(request, "fetch", "timeout", (int, float), 0.0)
    if count < 1 or timeout < 0:
        raise MalformedFrameError(f"fetch: max_messages {count} must be >= 1, timeout {timeout} >= 0")
    taken = await ctx.engine.fetch_columns(member, count, min(float(timeout), ctx.max_fetch_wait))
    ctx.metrics.count_columns(taken)
    return {"messages": columns_table(taken)}


async def nack(ctx: Context, request: Mapping[str, Any]) -> Reply:
    delay = need(request, "nack", "delay", (int, float), 0.0)
    if delay < 0:
        raise MalformedFrameError(f"nack: delay {delay} must be >= 0")
    await ctx.engine.nack(ctx.member(request, "nack"), strings(request, "nack", "receipts"),
                          float(delay))
    return {}


async def dead_letter(ctx: Context, request: Mapping[str, Any]) -> Reply:
    member = ctx.member(request, "dead_letter")
    receipts = strings(request, "dead_letter", "receipts")
    await ctx.engine.dead_letter(member, receipts, need(request, "dead_letter", "reason", str, ""))
    ctx.metrics.dead_lettered.labels(member.partition("/")[0]).inc(len(receipts))
    return {}


async def extend(ctx: Context, request: Mapping[str, Any]) -> Reply:
    await ctx.engine.extend(ctx.member(request, "extend"), strings(request, "extend", "receipts"))
    return {}


async def pending(ctx: Context, request: Mapping[str, Any]) -> Reply:
    group = need(request, "pending", "group", str)
    topics = strings(request, "pending", "topics")
    ctx.principal.check_consume(topics)
    return {"pending": await ctx.engine.pending(group, topics),
            "next_due": await ctx.engine.next_due(group)}


async def commit(ctx: Context, request: Mapping[str, Any]) -> Reply:
    member = ctx.member(request, "commit")
    offsets: dict[tuple[str, int], int] = {}
    for entry in need(request, "commit", "offsets", list):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in entry[1:])):
            raise MalformedFrameError(f"commit: offset entry {entry!r} must be [topic, queue, offset]")
        offsets[entry[0], entry[1]] = entry[2]
    await ctx.engine.commit(member, offsets)
    return {}


async def read(ctx: Context, request: Mapping[str, Any]) -> Reply:
    topic = need(request, "read", "topic", str)
    ctx.principal.check_consume([topic])
    queue, offset = need(request, "read", "queue", int), need(request, "read", "offset", int)
    count = need(request, "read", "max_messages", int, 500)
    deliveries = await ctx.engine.read(topic, queue, offset, count)
    return {"messages": delivery_table(deliveries)}


async def queue_offsets(ctx: Context, request: Mapping[str, Any]) -> Reply:
    topic = need(request, "queue_offsets", "topic", str)
    ctx.principal.check_consume([topic])
    return {"offsets": await ctx.engine.queue_offsets(topic)}


async def group_offsets(ctx: Context, request: Mapping[str, Any]) -> Reply:
    topic = need(request, "group_offsets", "topic", str)
    ctx.principal.check_consume([topic])
    return {"offsets": await ctx.engine.group_offsets(need(request, "group_offsets", "group", str), topic)}


async def commit_group(ctx: Context, request: Mapping[str, Any]) -> Reply:
    topic = need(request, "commit_group", "topic", str)
    ctx.principal.check_consume([topic])
    offsets = need(request, "commit_group", "offsets", list)
    if not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise MalformedFrameError("commit_group: offsets must be a list of int")
    await ctx.engine.commit_group(need(request, "commit_group", "group", str), topic, offsets)
    return {}


async def topics(ctx: Context, request: Mapping[str, Any]) -> Reply:
    return {"topics": [{"name": t.name, "queues": t.queues, "messages": t.messages}
                       for t in await ctx.engine.topics()]}


async def groups(ctx: Context, request: Mapping[str, Any]) -> Reply:
    return {"groups": [{"name": g.name, "topics": list(g.topics), "members": g.members,
                        "broadcast": g.broadcast} for g in await ctx.engine.groups()]}


async def lag(ctx: Context, request: Mapping[str, Any]) -> Reply:
    rows = await ctx.engine.lag(need(request, "lag", "group", str))
    return {"lag": [{"topic": q.topic, "queue": q.queue, "committed": q.committed, "end": q.end,
                     "lag": q.lag} for q in rows]}


async def ping(ctx: Context, request: Mapping[str, Any]) -> Reply:
    return {}


Operation = Callable[[Context, Mapping[str, Any]], Awaitable[Reply]]
OPERATIONS: dict[str, Operation] = {  # publish and ack: native_runs
    "publish_to_group": publish_to_group, "extend": extend, "pending": pending, "read": read,
    "queue_offsets": queue_offsets, "group_offsets": group_offsets, "commit_group": commit_group,
    "subscribe": subscribe, "unsubscribe": unsubscribe, "fetch": fetch, "nack": nack,
    "dead_letter": dead_letter, "commit": commit, "topics": topics, "groups": groups, "lag": lag,
    "ping": ping,
}
#: operations that may wait long: they run beside the connection's other requests
CONCURRENT = frozenset({"fetch", "read"})
