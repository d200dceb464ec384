"""The values the delivery engine takes and gives: what a producer sends, where it went, what a member receives.

They are shared by the engine, its in-process users (`broker.embedded`, the
framework's `embedded://` transport) and the server, which turns them into
frames of its two protocols.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import repeat
from operator import itemgetter, setitem
from typing import Any, TypeVar


@dataclass(frozen=True)
class OutgoingMessage:
    """A message to publish; a non-empty ``message_id`` lets the engine drop a resent duplicate."""

    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    message_id: str = ""
    queue: int | None = None
    deliver_at: float = 0.0
    """Seconds since the epoch before which the message is not delivered (0: at once)."""


@dataclass(frozen=True)
class Placement:
    """Where a published message went; ``duplicate`` if the engine already had its id."""

    topic: str
    queue: int
    offset: int
    message_id: str
    duplicate: bool = False


@dataclass(frozen=True)
class Delivery:
    """One message handed to a group member; ``delivery_count`` is 1 on the first delivery."""

    receipt: str
    topic: str
    queue: int
    offset: int
    message_id: str
    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    delivery_count: int = 1
    published_at: float = 0.0


_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C (itertools' "consume")
_new_object = object.__new__
_set_attribute = object.__setattr__
T = TypeVar("T")


def many(kind: type[T], count: int, same: Mapping[str, Any], columns: Mapping[str, Sequence[Any]]) -> list[T]:
    """``count`` values of the frozen dataclass ``kind``, each field either the same for all or
    taken from a column.

    Equal to calling ``kind`` ``count`` times, at a quarter of the cost: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__`` (about
    1.2 µs for eleven fields, most of a fetch's time per message), so here each
    instance gets a copy of one prepared ``__dict__`` with its columns filled in.
    """
    template = dict.fromkeys(spec.name for spec in fields(kind))  # type: ignore[arg-type]
    if set(same).union(columns) != template.keys():
        raise TypeError(f"{kind.__name__}: fields {sorted(set(same).union(columns) ^ template.keys())}")
    template.update(same)  # every key in place: filling a column replaces, never grows a copy
    values = list(map(dict.copy, repeat(template, count)))
    for name, column in columns.items():
        _run(map(setitem, values, repeat(name), column))
    made = list(map(_new_object, repeat(kind, count)))
    _run(map(_set_attribute, made, repeat("__dict__"), values))
    return made


def deliveries(count: int, same: Mapping[str, Any], columns: Mapping[str, Sequence[Any]]) -> list[Delivery]:
    """``count`` deliveries (see `many`)."""
    return many(Delivery, count, same, columns)


DELIVERY_FIELDS = tuple(spec.name for spec in fields(Delivery))


@dataclass(frozen=True)
class DeliveryColumns:
    """``count`` deliveries column by column, as a fetch reads them from the store: each field
    either the same for all (``same``) or one sequence of ``count`` values (``columns``).

    The server sends them so (the native protocol's table) without a `Delivery` per
    message; `deliveries` makes the values for callers in process.
    """

    count: int
    same: Mapping[str, Any]
    columns: Mapping[str, Sequence[Any]]

    def deliveries(self) -> list[Delivery]:
        return many(Delivery, self.count, self.same, self.columns) if self.count else []

    @classmethod
    def of(cls, given: Sequence[Delivery]) -> DeliveryColumns:
        """``given`` as columns, every field a column."""
        if not given:
            return NO_DELIVERIES
        values = map(itemgetter(*DELIVERY_FIELDS), map(vars, given))  # a dataclass without slots
        return cls(len(given), {}, dict(zip(DELIVERY_FIELDS, map(list, zip(*values)))))


NO_DELIVERIES = DeliveryColumns(0, {}, {})


def joined(parts: Sequence[DeliveryColumns]) -> DeliveryColumns:
    """The deliveries of ``parts`` one after another, as one `DeliveryColumns`: a field the same
    with one value in every part stays the same, any other becomes one column."""
    parts = [part for part in parts if part.count]
    if len(parts) <= 1:
        return parts[0] if parts else NO_DELIVERIES
    first = parts[0].same
    same = {name: value for name, value in first.items()
            if all(name in part.same and part.same[name] == value for part in parts[1:])}
    columns: dict[str, list[Any]] = {}
    for name in DELIVERY_FIELDS:
        if name in same:
            continue
        column: list[Any] = []
        for part in parts:
            found = part.columns.get(name)
            column += found if found is not None else repeat(part.same[name], part.count)
        columns[name] = column
    return DeliveryColumns(sum(part.count for part in parts), same, columns)


@dataclass(frozen=True)
class QueueLag:
    """How far a group is behind on one queue of a topic."""

    topic: str
    queue: int
    committed: int
    end: int

    @property
    def lag(self) -> int:
        return self.end - self.committed


@dataclass(frozen=True)
class TopicInfo:
    name: str
    queues: int
    messages: int


@dataclass(frozen=True)
class GroupInfo:
    name: str
    topics: tuple[str, ...]
    members: int
    broadcast: bool
