"""Every broker operation, declared once: its fields, reply, whether it waits, the right it needs.

The layers are derived from this table, not written per operation: the
native server validates a request's fields and checks its `Access` from it
(`broker.server.native_ops`), the server's engine adapter runs its engine
function on the right thread pool (``waits``: a long poll gets the pool of
its own), the sync, asyncio and local-socket clients get one method per
operation (`broker.protocol.calls`), STOMP frames are checked with the
`Access` of the operation they map onto, and docs/broker-server.md lists
the permissions from it (`permission_table`).

An operation's ``method`` is its name in Python (a `BrokerApi` call where
the engine has one); ``name`` is its name on the wire (``subscribe`` joins
a group). ``engine`` is the function the server calls with the engine
first; by default the engine's method of the same name. The operations
whose ``method`` is a call of the engine (``api``: by default those without
an ``engine`` function) make up `broker.delivery.api.BrokerApi`, generated
from this table by `broker.protocol.generate`, each with its ``doc``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from broker.protocol.access import Access, Rights, may_see_topic
from broker.protocol.errors import MalformedFrameError
from broker.protocol.kinds import (
    ANY,
    BOOL,
    DELIVERIES,
    DELIVERY_COLUMNS,
    FOUND,
    GROUP_INFOS,
    INT,
    INTS,
    INTS_OR_NIL,
    LAGS,
    NUMBER,
    OFFSET_PAIRS,
    OFFSETS,
    OUTGOING,
    PLACEMENTS,
    QUEUES,
    STR,
    STRS,
    TOPIC_INFOS,
    Kind,
)

REQUIRED: Any = object()


@dataclass(frozen=True)
class Field:
    """One field of a request (or the reply): its name, kind, default and lower bound.

    In the `BrokerApi` call a field is a required positional argument (the default
    is the server's, for clients that leave it out), a keyword-only one with the
    default (``keyword``), or not there at all (``wire_only``)."""

    name: str
    kind: Kind
    default: Any = REQUIRED
    minimum: float | None = None
    above: bool = False  # the bound is exclusive
    keyword: bool = False
    wire_only: bool = False

    def parse(self, op: str, request: Mapping[str, Any]) -> Any:
        """The Python value of this field of ``request``; `MalformedFrameError` naming op and field."""
        if self.name not in request or (request[self.name] is None and self.default is not REQUIRED):
            if self.default is REQUIRED:
                raise MalformedFrameError(f"{op}: field {self.name!r} is required")
            return self.default
        value = request[self.name]
        if not self.kind.check(value):
            raise MalformedFrameError(
                f"{op}: field {self.name!r} must be {self.kind.expected}, got {type(value).__name__}")
        if self.minimum is not None and value is not None and (
                value <= self.minimum if self.above else value < self.minimum):
            raise MalformedFrameError(
                f"{op}: field {self.name!r} must be {'>' if self.above else '>='} {self.minimum:g}, got {value}")
        return self.kind.load(value)


def _member() -> Field:
    return Field("member", STR)


def _receipts() -> Field:
    return Field("receipts", STRS)


@dataclass(frozen=True)
class Operation:
    """One request of the native protocol and what it means (see the module docstring)."""

    name: str
    fields: tuple[Field, ...]
    reply: Field | None
    access: Access
    waits: bool = False
    method: str = ""
    engine: Callable[..., Any] | None = None
    doc: str = ""
    api: bool | None = None

    def __post_init__(self) -> None:
        if not self.access.declared:
            raise TypeError(f"operation {self.name!r} declares no access: every operation names "
                            "the right it needs (broker.protocol.access.Access)")
        if not self.method:
            object.__setattr__(self, "method", self.name)
        if self.api is None:
            object.__setattr__(self, "api", self.engine is None)
        object.__setattr__(self, "_kinds", {f.name: f.kind for f in self.fields})

    def parse(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The request's fields as Python values, every one checked, defaults filled in."""
        return {f.name: f.parse(self.name, request) for f in self.fields}

    def request(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A client's call as the request's wire fields (None left out: the server's default)."""
        kinds: dict[str, Kind] = self._kinds  # type: ignore[attr-defined]
        if len(args) > len(kinds) or not kinds.keys() >= kwargs.keys():
            raise TypeError(f"{self.method}() takes {', '.join(kinds) or 'no arguments'}")
        given = {**dict(zip(kinds, args)), **kwargs} if args else kwargs
        return {name: kinds[name].dump(value) for name, value in given.items() if value is not None}

    def call(self, api: Any, args: Mapping[str, Any]) -> Any:
        """Run this operation on the engine ``api`` (in the process that owns it)."""
        if self.engine is not None:
            return self.engine(api, **args)
        return getattr(api, self.method)(**args)

    def answer(self, result: Any) -> dict[str, Any]:
        """The reply's wire fields for the engine's ``result``."""
        return {} if self.reply is None else {self.reply.name: self.reply.kind.dump(result)}

    def result(self, reply: Mapping[str, Any]) -> Any:
        """A client's value of the reply (None for an empty reply)."""
        return None if self.reply is None else self.reply.kind.load(reply[self.reply.name])


def _shows_group(rights: Rights, group: Any) -> bool:
    return bool(rights.may_join(group.name))


def _shows_topic(rights: Rights, topic: Any) -> bool:
    return may_see_topic(rights, topic.name)


def _shows_lag(rights: Rights, lag: Any) -> bool:
    return may_see_topic(rights, lag.topic)


def _shows_found(rights: Rights, found: Any) -> bool:
    return found is not None and bool(rights.may_consume(found.topic))


def _stats(api: Any) -> dict[str, float]:
    """Topics, messages, groups and members the engine holds (the server adds its counters)."""
    topics = [t for t in api.topics() if not t.name.startswith("%")]
    groups = api.groups()
    return {"topics": len(topics), "messages": sum(t.messages for t in topics),
            "groups": len(groups), "members": sum(g.members for g in groups)}


def _lookup(name: str) -> Callable[..., Any]:
    """`broker.delivery.lookup`'s ``name``, imported at its first call: only the process that
    runs the engine calls it, so a client (a Spark reader) does not import the store with the table."""

    def call(api: Any, **args: Any) -> Any:
        from broker.delivery import lookup

        return getattr(lookup, name)(api, **args)
    return call


def _publish(api: Any, topic: str, messages: Any, batch: str = "") -> Any:
    """A publish run on the engine (a local call through the owner of an embedded directory):
    its messages name themselves by id. A batch id is the network protocol's, which the server
    turns into names for the messages on its own path (`broker.server.native_runs`)."""
    if batch:
        raise MalformedFrameError("publish: a batch id is taken over the network only; name the messages by id")
    return api.publish(topic, messages)


def _table(operations: Iterable[Operation]) -> dict[str, Operation]:
    table: dict[str, Operation] = {}
    for op in operations:
        if op.name in table:
            raise TypeError(f"operation {op.name!r} is declared twice")
        table[op.name] = op
    return table


TOPIC, GROUP, MEMBER = Field("topic", STR), Field("group", STR), _member()
OPERATIONS: dict[str, Operation] = _table([
    Operation("publish", (TOPIC, Field("messages", OUTGOING), Field("batch", STR, "", wire_only=True)),
              Field("placements", PLACEMENTS), Access(produce=("topic",)), engine=_publish, api=True,
              doc="Append ``messages`` to ``topic`` in order; durable per the flush setting when this returns."),
    Operation("publish_to_group", (GROUP, TOPIC, Field("messages", OUTGOING)),
              Field("placements", PLACEMENTS),
              Access(produce=("topic",), consume=("topic",), group="group"),
              doc="Deliver ``messages`` of ``topic`` to ``group`` only (through ``%RETRY%<group>``)."),
    Operation("subscribe", (GROUP, Field("topics", STRS), Field("broadcast", BOOL, False, keyword=True),
                            Field("from_end", BOOL, False, keyword=True),
                            Field("prefetch", INT, None, 1, keyword=True),
                            Field("lease", NUMBER, None, 0, above=True, keyword=True),
                            Field("tags", STRS, None, keyword=True)),
              Field("member", STR), Access(consume=("topics",), group="group"), method="join",
              doc="A new member of ``group`` over ``topics``; ``from_end``: a new group starts at the "
                  "end; ``prefetch`` and ``lease`` override the broker's; ``tags``: only these "
                  "(else UNMATCHED)."),
    Operation("unsubscribe", (MEMBER,), None, Access(member=True), method="leave",
              doc="End ``member``; what it held unacknowledged is redelivered to the group."),
    Operation("fetch", (MEMBER, Field("max_messages", INT, 100, 1), Field("timeout", NUMBER, 0.0, 0)),
              Field("messages", DELIVERIES), Access(member=True), waits=True,
              doc="Up to ``max_messages``, waiting up to ``timeout`` seconds for the first one."),
    Operation("ack", (MEMBER, _receipts()), None, Access(member=True),
              doc="STANDARD: these deliveries are done."),
    Operation("nack", (MEMBER, _receipts(), Field("delay", NUMBER, 0.0, 0)), None, Access(member=True),
              doc="REDELIVERED: deliver these again, not before ``delay`` seconds; the delivery "
                  "count goes up."),
    Operation("dead_letter", (MEMBER, _receipts(), Field("reason", STR, "")), None, Access(member=True),
              doc="POISON: move these to the group's dead-letter queue ``%DLQ%<group>`` with ``reason``."),
    Operation("extend", (MEMBER, _receipts()), None, Access(member=True),
              doc="Still working on these: their leases start again."),
    Operation("release", (MEMBER, _receipts()), None, Access(member=True),
              doc="RELEASED: these never reached the application (fetched ahead, not received): "
                  "delivered again as if never handed out, their delivery count unmoved."),
    Operation("commit", (MEMBER, Field("offsets", OFFSETS)), None, Access(member=True),
              doc="Offsets kept by the consumer: the next offset to read per (topic, queue); seeks there."),
    Operation("assignment", (MEMBER,), Field("assignment", QUEUES), Access(member=True),
              doc="The (topic, queue) pairs ``member`` holds now."),
    Operation("pending", (GROUP, Field("topics", STRS)), Field("pending", INT),
              Access(consume=("topics",), group="group"),
              doc="Messages of ``topics`` (and the group's retry topic) ``group`` has not finished "
                  "(a topic the broker does not hold has none, and is not made)."),
    Operation("next_due", (GROUP,), Field("next_due", NUMBER.optional()), Access(group="group"),
              doc="When the earliest delayed message ``group`` holds back falls due, or None."),
    Operation("read", (TOPIC, Field("queue", INT, minimum=0), Field("offset", INT, minimum=0),
                       Field("max_messages", INT, 500, 1)),
              Field("messages", DELIVERIES), Access(consume=("topic",)), waits=True,
              doc="Messages of (topic, queue) from ``offset`` on, outside any group (a stream processor)."),
    Operation("read_columns", (TOPIC, Field("queue", INT, minimum=0), Field("offset", INT, minimum=0),
                               Field("max_messages", INT, 500, 1)),
              Field("messages", DELIVERY_COLUMNS), Access(consume=("topic",)), waits=True,
              doc="`read` column by column (no `Delivery` per message: a columnar reader's call)."),
    Operation("queue_offsets", (TOPIC,), Field("offsets", OFFSET_PAIRS), Access(consume=("topic",)),
              doc="``[first kept, end]`` per queue of ``topic``."),
    Operation("group_offsets", (GROUP, TOPIC), Field("offsets", INTS_OR_NIL),
              Access(consume=("topic",), group="group"),
              doc="``group``'s committed offset per queue of ``topic`` (None: never committed; no "
                  "queues for a topic the broker does not hold, which is not made)."),
    Operation("commit_group", (GROUP, TOPIC, Field("offsets", INTS)), None,
              Access(consume=("topic",), group="group"),
              doc="Record the next offset per queue as ``group``'s (a stream processor's commit)."),
    Operation("topics", (), Field("topics", TOPIC_INFOS), Access(anyone=True, shows=_shows_topic),
              doc="Every topic with its queue and message counts and the bytes its messages take."),
    Operation("groups", (), Field("groups", GROUP_INFOS), Access(anyone=True, shows=_shows_group),
              doc="Every consumer group the engine knows."),
    Operation("lag", (GROUP,), Field("lag", LAGS), Access(group="group", shows=_shows_lag),
              doc="``group``'s committed offset against the end of each queue it reads."),
    Operation("dlq_list", (GROUP, Field("limit", INT, 100, 1), Field("body_limit", INT, None, 0, keyword=True)),
              Field("messages", DELIVERIES), Access(dead_letters="group"),
              doc="The first ``limit`` messages of ``group``'s dead-letter queue (with ``body_limit``, "
                  "each body cut to its first bytes, its whole size in ``x-dlq-body-size``)."),
    Operation("dlq_waiting", (GROUP,), Field("waiting", INT), Access(dead_letters="group"),
              engine=_lookup("dlq_waiting"), doc="How many messages ``group``'s dead-letter queue holds."),
    Operation("dlq_replay", (GROUP,), Field("replayed", INT), Access(dead_letters="group"), waits=True,
              doc="Every dead letter of ``group`` back to the group only, emptying its dead-letter "
                  "queue; how many."),
    Operation("dlq_purge", (GROUP,), Field("purged", INT), Access(dead_letters="group"),
              doc="Drop ``group``'s dead letters; how many."),
    Operation("dlq_replay_letters", (GROUP, Field("offsets", INTS)), Field("replayed", INT),
              Access(dead_letters="group"), waits=True,
              doc="The dead letters of ``group`` at ``offsets`` (of ``%DLQ%<group>``) back to the group "
                  "only; the others stay; how many were waiting."),
    Operation("dlq_purge_letters", (GROUP, Field("offsets", INTS)), Field("purged", INT),
              Access(dead_letters="group"),
              doc="Drop the dead letters of ``group`` at ``offsets``; the others stay; how many were waiting."),
    Operation("lookup_key", (TOPIC, Field("key", STR), Field("begin", NUMBER, 0.0),
                             Field("end", NUMBER, 2.0**40), Field("limit", INT, 64, 1)),
              Field("messages", DELIVERIES), Access(consume=("topic",)), engine=_lookup("by_key"),
              doc="Messages of ``topic`` with ``key`` stored between ``begin`` and ``end`` (epoch seconds)."),
    Operation("lookup_id", (Field("message_id", STR),), Field("messages", FOUND),
              Access(anyone=True, shows=_shows_found), engine=_lookup("by_id"),
              doc="The message named ``message_id``, or None."),
    Operation("stats", (), Field("stats", ANY), Access(anyone=True, shows=lambda r, s: True),
              engine=_stats, doc="Topics, messages, groups and members the engine holds."),
    Operation("ping", (), None, Access(anyone=True), engine=lambda api: None,
              doc="Nothing: whether the broker answers."),
])
BY_METHOD: dict[str, Operation] = {op.method: op for op in OPERATIONS.values()}


def permission_table(operations: Mapping[str, Operation] = OPERATIONS) -> str:
    """The Markdown table of docs/broker-server.md: each operation and the rights it needs."""
    lines = ["| operation | Python call | needs (or admin) | waits |", "|---|---|---|---|"]
    for op in operations.values():
        lines.append(f"| `{op.name}` | `{op.method}` | {op.access.describe()} | "
                     f"{'yes' if op.waits else ''} |")
    return "\n".join(lines) + "\n"
