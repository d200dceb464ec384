"""The values the delivery engine takes and gives: what a producer sends, where it went, what a member receives.

They are shared by the engine, its in-process users (`broker.embedded`, the
framework's `embedded://` transport) and the server, which turns them into
frames of its two protocols.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from itertools import repeat
from operator import attrgetter, itemgetter, setitem
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, TypeVar

NO_HEADERS: Mapping[str, str] = MappingProxyType({})  # a default no one can change


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


class Delivery(NamedTuple):
    """One message handed to a group member; ``delivery_count`` is 1 on the first delivery.

    A named tuple where the other values are frozen dataclasses: a fetch makes one per
    message, and a tuple is made in C from a row of columns at a third of a dataclass's
    cost (``_replace`` and ``_asdict`` stand for `dataclasses.replace` and ``asdict``).
    """

    receipt: str
    topic: str
    queue: int
    offset: int
    message_id: str
    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = NO_HEADERS
    delivery_count: int = 1
    published_at: float = 0.0


_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C (itertools' "consume")
_new_object = object.__new__
_set_attribute = object.__setattr__
T = TypeVar("T")


def many(kind: type[T], count: int, same: Mapping[str, Any], columns: Mapping[str, Sequence[Any]]) -> list[T]:
    """``count`` values of ``kind`` (a frozen dataclass or `Delivery`), each field either the same
    for all or taken from a column.

    Equal to calling ``kind`` ``count`` times, at a quarter of the cost: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__`` (about
    1.2 µs for eleven fields), so here each instance gets a copy of one prepared
    ``__dict__`` with its columns filled in; a named tuple is made from its row.
    """
    names = field_names(kind)
    if set(same).union(columns) != set(names):
        raise TypeError(f"{kind.__name__}: fields {sorted(set(same).union(columns) ^ set(names))}")
    if issubclass(kind, tuple):
        row_columns = [columns[name] if name in columns else repeat(same[name], count) for name in names]
        return list(map(tuple.__new__, repeat(kind), zip(*row_columns)))  # type: ignore[call-overload]
    template = dict.fromkeys(names)
    template.update(same)  # every key in place: filling a column replaces, never grows a copy
    values = list(map(dict.copy, repeat(template, count)))
    for name, column in columns.items():
        _run(map(setitem, values, repeat(name), column))
    made = list(map(_new_object, repeat(kind, count)))
    _run(map(_set_attribute, made, repeat("__dict__"), values))
    return made


def field_names(kind: type) -> tuple[str, ...]:
    """The fields of ``kind`` (a dataclass or a named tuple), in order."""
    if issubclass(kind, tuple):
        return kind._fields  # type: ignore[attr-defined, no-any-return]
    return tuple(spec.name for spec in fields(kind))  # type: ignore[arg-type]


def field_defaults(kind: type) -> dict[str, Any]:
    """The default value of each field of ``kind`` that has one (a factory's made anew)."""
    if issubclass(kind, tuple):
        return dict(kind._field_defaults)  # type: ignore[attr-defined]
    return {spec.name: spec.default if spec.default is not MISSING else spec.default_factory()  # type: ignore[misc, operator]
            for spec in fields(kind)  # type: ignore[arg-type]
            if spec.default is not MISSING or spec.default_factory is not MISSING}


def as_dict(value: Any) -> dict[str, Any]:
    """The fields of ``value`` (a dataclass or a named tuple) by name, not recursively."""
    return value._asdict() if isinstance(value, tuple) else dict(vars(value))  # type: ignore[no-any-return, attr-defined]


def columns_of(values: Sequence[Any], names: Sequence[str]) -> Iterable[tuple[Any, ...]]:
    """The ``names`` fields of ``values`` (dataclasses without slots or named tuples), one tuple
    per field, made in C."""
    if not values:
        return repeat((), len(names))
    if isinstance(values[0], tuple):  # every field in order: the rows themselves
        return zip(*values) if tuple(names) == field_names(type(values[0])) else zip(*map(attrgetter(*names), values))
    return zip(*map(itemgetter(*names), map(vars, values)))


def deliveries(count: int, same: Mapping[str, Any], columns: Mapping[str, Sequence[Any]]) -> list[Delivery]:
    """``count`` deliveries (see `many`)."""
    return many(Delivery, count, same, columns)


DELIVERY_FIELDS = Delivery._fields
MESSAGE_FIELDS = field_names(OutgoingMessage)
PLACEMENT_FIELDS = field_names(Placement)
C = TypeVar("C", bound="Columns")


@dataclass(frozen=True)
class Columns:
    """``count`` values of the frozen dataclass ``KIND`` column by column: each field either the
    same for all (``same``) or one sequence of ``count`` values (``columns``).

    What the engine takes and gives in bulk, and what the native protocol carries as a table:
    no object per message on the way (see `many` for making the values in process).
    """

    KIND: ClassVar[type]
    count: int
    same: Mapping[str, Any]
    columns: Mapping[str, Sequence[Any]]

    def column(self, name: str) -> Sequence[Any]:
        """The values of field ``name``, one per row."""
        found = self.columns.get(name)
        return found if found is not None else [self.same[name]] * self.count

    def rows(self) -> list[Any]:
        return many(self.KIND, self.count, self.same, self.columns) if self.count else []

    def taken(self: C, positions: Sequence[int]) -> C:
        """Only the rows at ``positions``, in that order."""
        return type(self)(len(positions), self.same, {
            name: list(map(column.__getitem__, positions)) for name, column in self.columns.items()})

    def with_column(self: C, name: str, values: Sequence[Any]) -> C:
        """The same rows with field ``name`` set to ``values`` (one per row)."""
        same = {field: value for field, value in self.same.items() if field != name}
        return type(self)(self.count, same, {**self.columns, name: values})

    def split(self: C, counts: Sequence[int]) -> list[C]:
        """The rows in consecutive parts of ``counts`` rows each."""
        parts, start = [], 0
        for count in counts:
            parts.append(type(self)(count, self.same, {
                name: column[start:start + count] for name, column in self.columns.items()}))
            start += count
        return parts

    @classmethod
    def of(cls: type[C], given: Sequence[Any]) -> C:
        """``given`` (values of ``KIND``) as columns, every field a column."""
        if not given:
            return cls(0, {}, {})
        names = field_names(cls.KIND)
        return cls(len(given), {}, dict(zip(names, map(list, columns_of(given, names)))))

    @classmethod
    def joined(cls: type[C], parts: Sequence[C]) -> C:
        """The rows of ``parts`` one after another: a field the same with one value in every
        part stays the same, any other becomes one column."""
        parts = [part for part in parts if part.count]
        if len(parts) <= 1:
            return parts[0] if parts else cls(0, {}, {})
        first = parts[0].same
        same = {name: value for name, value in first.items()
                if all(name in part.same and part.same[name] == value for part in parts[1:])}
        columns: dict[str, list[Any]] = {}
        for name in field_names(cls.KIND):
            if name in same:
                continue
            column: list[Any] = []
            for part in parts:
                found = part.columns.get(name)
                column += found if found is not None else repeat(part.same[name], part.count)
            columns[name] = column
        return cls(sum(part.count for part in parts), same, columns)


@dataclass(frozen=True)
class DeliveryColumns(Columns):
    """Deliveries as a fetch reads them from the store. The server sends them so (the native
    protocol's table) without a `Delivery` per message; `deliveries` makes the values for
    callers in process."""

    KIND = Delivery

    def deliveries(self) -> list[Delivery]:
        return self.rows()


@dataclass(frozen=True)
class MessageColumns(Columns):
    """Messages to publish, every field of `OutgoingMessage` in ``same`` or ``columns``, as the
    server checks them from a publish's table (`of` makes them of `OutgoingMessage` values)."""

    KIND = OutgoingMessage

    def messages(self) -> list[OutgoingMessage]:
        return self.rows()


@dataclass(frozen=True)
class PlacementColumns(Columns):
    """Where a publish's messages went, as the engine learns it from the store's append; the
    server sends them so, `placements` makes the values for callers in process."""

    KIND = Placement

    def placements(self) -> list[Placement]:
        return self.rows()


NO_DELIVERIES = DeliveryColumns(0, {}, {})


def joined(parts: Sequence[DeliveryColumns]) -> DeliveryColumns:
    """The deliveries of ``parts`` one after another (see `Columns.joined`)."""
    return DeliveryColumns.joined(parts)


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
    bytes: int = 0  # what the kept messages take in the commit log (0 from a server that does not say)


@dataclass(frozen=True)
class GroupInfo:
    name: str
    topics: tuple[str, ...]
    members: int
    broadcast: bool
