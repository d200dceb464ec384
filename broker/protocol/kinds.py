"""How each value of the native protocol travels: the kinds of the operations' fields and replies.

A `Kind` says what a value must look like on the wire (checked by the
server before any engine call, so a bad request is refused naming the
field and what was expected), how a client puts a Python value on the wire
(``dump``) and how the receiver turns the wire value back (``load``), and
its type in Python (``python``, the annotation `broker.delivery.api` is
generated with). `broker.protocol.operations` declares every field and
reply with one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from broker.delivery.values import (
    DELIVERY_FIELDS,
    Delivery,
    GroupInfo,
    OutgoingMessage,
    Placement,
    QueueLag,
    TopicInfo,
)
from broker.protocol.tables import (
    checked_messages,
    column_table,
    delivery_columns,
    outgoing_table,
    rows,
    table,
)


def _same(value: Any) -> Any:
    return value


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _all(kinds: tuple[type, ...]) -> Callable[[Any], bool]:
    allowed = set(kinds)
    return lambda value: type(value) is list and set(map(type, value)) <= allowed  # checked in C


@dataclass(frozen=True)
class Kind:
    """A value's shape on the wire: ``expected`` names it in errors, ``check`` tests a wire value,
    ``dump`` makes the wire value of a Python one, ``load`` the Python value of a wire one;
    ``python`` is the annotation of the Python value (names of `broker.delivery.values`)."""

    expected: str
    check: Callable[[Any], bool]
    dump: Callable[[Any], Any] = field(default=_same)
    load: Callable[[Any], Any] = field(default=_same)
    python: str = "Any"

    def optional(self) -> Kind:
        """This kind or nil."""
        return Kind(f"{self.expected} or nil", lambda v: v is None or self.check(v),
                    lambda v: None if v is None else self.dump(v),
                    lambda v: None if v is None else self.load(v), f"{self.python} | None")


STR = Kind("str", lambda v: type(v) is str, python="str")
INT = Kind("int", lambda v: type(v) is int, python="int")
NUMBER = Kind("a number", _number, load=float, python="float")
BOOL = Kind("bool", lambda v: type(v) is bool, python="bool")
STRS = Kind("a list of str", _all((str,)), dump=list, python="Sequence[str]")
INTS = Kind("a list of int", _all((int,)), dump=list, python="Sequence[int]")
INTS_OR_NIL = Kind("a list of int or nil", _all((int, type(None))), python="list[int | None]")
ANY = Kind("any value", lambda v: True)


def _offset_entries(value: Any) -> bool:
    return type(value) is list and all(
        type(e) is list and len(e) == 3 and type(e[0]) is str and type(e[1]) is int
        and type(e[2]) is int for e in value)


OFFSETS = Kind("a list of [topic, queue, offset]", _offset_entries,
               dump=lambda offsets: [[t, q, o] for (t, q), o in offsets.items()],
               load=lambda entries: {(t, q): o for t, q, o in entries},
               python="Mapping[tuple[str, int], int]")
"""A member's offsets per (topic, queue): a map in Python, ``[topic, queue, offset]`` entries on the wire."""

OUTGOING = Kind("a table of messages", lambda v: type(v) is dict,
                dump=lambda messages: outgoing_table(messages, [m.message_id for m in messages]),
                load=lambda carried: checked_messages(carried, "messages"),
                python="Sequence[OutgoingMessage]")


def _rows_of(kind: type, names: Sequence[str] | None = None) -> Kind:
    """Values of the frozen dataclass ``kind`` as a table (broker.protocol.tables)."""
    return Kind(f"a table of {kind.__name__}", lambda v: type(v) is dict,
                dump=lambda values: table(values, names or [f.name for f in fields(kind)]),
                load=lambda carried: rows(kind, carried, kind.__name__), python=f"list[{kind.__name__}]")


DELIVERIES = _rows_of(Delivery, DELIVERY_FIELDS)
PLACEMENTS = _rows_of(Placement)
DELIVERY_COLUMNS = Kind("a table of Delivery", lambda v: type(v) is dict,
                        dump=lambda c: column_table(c.count, c.same, c.columns),
                        load=lambda carried: delivery_columns(carried, "messages"),
                        python="DeliveryColumns")
"""`DeliveryColumns` as the same table: no `Delivery` made per message at either end."""


def _first(deliveries: list[Delivery]) -> Delivery | None:
    return deliveries[0] if deliveries else None


FOUND = Kind("a table of at most one Delivery", lambda v: type(v) is dict,
             dump=lambda found: DELIVERIES.dump([] if found is None else [found]),
             load=lambda carried: _first(DELIVERIES.load(carried)), python="Delivery | None")


def _maps(kind: type, dump: Callable[[Any], Mapping[str, Any]],
          load: Callable[[Mapping[str, Any]], Any]) -> Kind:
    return Kind(f"a list of {kind.__name__} maps", lambda v: type(v) is list,
                dump=lambda values: [dict(dump(v)) for v in values],
                load=lambda maps: [load(m) for m in maps], python=f"list[{kind.__name__}]")


TOPIC_INFOS = _maps(TopicInfo, lambda t: {"name": t.name, "queues": t.queues, "messages": t.messages,
                                              "bytes": t.bytes},
                    lambda t: TopicInfo(**t))
GROUP_INFOS = _maps(GroupInfo, lambda g: {"name": g.name, "topics": list(g.topics),
                                          "members": g.members, "broadcast": g.broadcast},
                    lambda g: GroupInfo(**{**g, "topics": tuple(g["topics"])}))
LAGS = _maps(QueueLag, lambda q: {"topic": q.topic, "queue": q.queue, "committed": q.committed,
                                  "end": q.end, "lag": q.lag},
             lambda q: QueueLag(q["topic"], q["queue"], q["committed"], q["end"]))
QUEUES = Kind("a list of [topic, queue]", lambda v: type(v) is list,
               dump=lambda pairs: [list(p) for p in pairs], load=lambda pairs: [(t, q) for t, q in pairs],
               python="list[tuple[str, int]]")
OFFSET_PAIRS = Kind("a list of [first, end]", lambda v: type(v) is list,
                    load=lambda pairs: [list(p) for p in pairs], python="list[list[int]]")

__all__ = ["ANY", "BOOL", "DELIVERIES", "DELIVERY_COLUMNS", "FOUND", "GROUP_INFOS", "INT", "INTS", "INTS_OR_NIL", "LAGS", "NUMBER",
           "OFFSETS", "OFFSET_PAIRS", "OUTGOING", "PLACEMENTS", "QUEUES", "STR", "STRS", "TOPIC_INFOS",
           "Kind", "OutgoingMessage"]
