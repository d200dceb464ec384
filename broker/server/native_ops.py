"""The native protocol's operations served: every request checked and authorised from the table.

`serve` is the one path of every request but the runs of `native_runs`:
the operation's fields are parsed as `broker.protocol.operations` declares
them (a bad field is refused naming the operation, the field and what was
expected, see broker/PROTOCOL.md), its `Access` is checked against the
caller, and its engine function runs on the engine's pools. The few
operations that touch the connection's own state (the members it joined)
or the server's metrics add a step of their own in `STEPS`; a listing's
reply shows only what the caller may see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.errors import UnknownMemberError
from broker.protocol.errors import MalformedFrameError, RequestLimitError
from broker.protocol.operations import OPERATIONS, Operation
from broker.protocol.tables import Table, column_table
from broker.server.auth import Principal
from broker.server.engine import ByteWindow, DeliveryColumns, Engine, PlacementColumns
from broker.server.metrics import ServerMetrics
from broker.server.quota import GroupQuota, TopicQuota

Reply = dict[str, Any]


@dataclass
class Context:
    """What an operation may use: the engine, the caller, the members this connection joined
    and the window their unacknowledged messages share (``max_unacked_bytes``)."""

    engine: Engine
    principal: Principal
    metrics: ServerMetrics
    max_fetch_wait: float
    max_subscriptions: int = 1000
    max_fetch_messages: int = 10_000
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    window: ByteWindow = field(default_factory=ByteWindow)
    quota: GroupQuota = field(default_factory=GroupQuota.unbounded)  # the server's (max_groups_per_user)
    topic_quota: TopicQuota = field(default_factory=TopicQuota.unbounded)  # max_topics_per_user

    def member(self, member: str, op: str) -> str:
        if member not in self.members:  # it left, or joined on another connection (or none)
            raise UnknownMemberError(f"{op}: member {member!r} was not joined on this connection")
        return member

    def authorise(self, op: Operation, args: Mapping[str, Any]) -> None:
        """`PermissionDeniedError` (or `UnknownMemberError`) unless the caller may run ``op``."""
        if op.access.member:
            self.member(args["member"], op.name)
        op.access.check(self.principal, args)


def need(request: Mapping[str, Any], op: str, name: str, kind: type, default: Any = ...) -> Any:
    """``request[name]`` if it has type ``kind`` (the handshake's fields, outside the table)."""
    value = request.get(name, default)
    if value is ...:
        raise MalformedFrameError(f"{op}: field {name!r} is required")
    if value is not default and type(value) is not kind:
        raise MalformedFrameError(f"{op}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def columns_table(taken: DeliveryColumns) -> Table:
    return column_table(taken.count, taken.same, taken.columns)


def placements_reply(placed: PlacementColumns) -> Reply:
    return {"placements": column_table(placed.count, placed.same, placed.columns)}


async def serve(ctx: Context, op: Operation, request: Mapping[str, Any]) -> Reply:
    """Parse, authorise and run one request of ``op``; its reply's fields."""
    args = op.parse(request)
    ctx.authorise(op, args)
    for name in COUNTS.intersection(args):  # "up to": a client asking for more gets this many
        if args[name] is not None:
            args[name] = min(args[name], ctx.max_fetch_messages)
    with ctx.topic_quota.naming(ctx.principal, op.access.topics(args)):
        step = STEPS.get(op.name)
        if step is not None:
            return await step(ctx, op, args)
        result = await ctx.engine.call(op, args)
    if op.access.shows is not None:
        result = _shown(ctx, op, result)
    return op.answer(result)


def _shown(ctx: Context, op: Operation, result: Any) -> Any:
    if isinstance(result, list):
        return op.access.visible(ctx.principal, result)
    return result if op.access.visible(ctx.principal, [result]) else None


COUNTS = frozenset({"max_messages", "limit", "prefetch"})
"""The fields that say how many messages a reply may hold (fetch, read, dlq_list, lookup_key) or a
member holds unacknowledged (subscribe's prefetch: the engine keeps each until its ack): each is
held in memory, so one request must not ask for a whole topic."""
Step = Callable[[Context, Operation, dict[str, Any]], Awaitable[Reply]]


async def _subscribe(ctx: Context, op: Operation, args: dict[str, Any]) -> Reply:
    if not args["group"] or not args["topics"]:
        raise MalformedFrameError("subscribe: group and topics must not be empty")
    if len(ctx.members) >= ctx.max_subscriptions:  # each member costs the group a rebalance
        raise RequestLimitError(f"subscribe: this connection holds {len(ctx.members)} members, "
                                     f"max_subscriptions={ctx.max_subscriptions}; unsubscribe some first")
    with ctx.quota.joining(ctx.principal, args["group"]):
        member = await ctx.engine.call(op, args)
    ctx.members[member] = tuple(args["topics"])
    await ctx.engine.share_window(member, ctx.window)
    return op.answer(member)


async def _unsubscribe(ctx: Context, op: Operation, args: dict[str, Any]) -> Reply:
    del ctx.members[args["member"]]
    await ctx.engine.leave(args["member"])
    return {}


async def _fetch(ctx: Context, op: Operation, args: dict[str, Any]) -> Reply:
    taken = await ctx.engine.fetch_columns(args["member"], args["max_messages"],
                                           min(args["timeout"], ctx.max_fetch_wait))
    ctx.metrics.count_columns(taken)
    return {"messages": columns_table(taken)}


async def _dead_letter(ctx: Context, op: Operation, args: dict[str, Any]) -> Reply:
    await ctx.engine.call(op, args)
    ctx.metrics.dead_lettered.labels(args["member"].partition("/")[0]).inc(len(args["receipts"]))
    return {}


async def _pending(ctx: Context, op: Operation, args: dict[str, Any]) -> Reply:
    """``pending``, and ``next_due`` beside it as clients before the ``next_due`` operation read it."""
    return {**op.answer(await ctx.engine.call(op, args)),
            **await serve(ctx, OPERATIONS["next_due"], {"group": args["group"]})}


async def _stats(ctx: Context, op: Operation, args: dict[str, Any]) -> Reply:
    """Counts over the topics and groups the caller may see; the server's counters for an admin."""
    topics = await serve(ctx, OPERATIONS["topics"], {})
    groups = await serve(ctx, OPERATIONS["groups"], {})
    shown = [t for t in topics["topics"] if not t["name"].startswith("%")]
    stats: dict[str, float] = {
        "topics": len(shown), "messages": sum(t["messages"] for t in shown),
        "groups": len(groups["groups"]), "members": sum(g["members"] for g in groups["groups"])}
    return op.answer({**stats, **ctx.metrics.totals()} if ctx.principal.admin else stats)


STEPS: dict[str, Step] = {
    "subscribe": _subscribe, "unsubscribe": _unsubscribe, "fetch": _fetch,
    "dead_letter": _dead_letter, "pending": _pending, "stats": _stats,
}
