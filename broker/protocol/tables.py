"""Lists of messages as the native protocol carries them: one table, column by column.

A publish's messages, its placements and a fetch's deliveries travel as

    {"count": n, "same": {field: value}, "columns": {field: [n values]}}

a field equal in every row once in ``same``, each other field as one list. Both
ends then pack and unpack a few long arrays instead of n maps, and the
receiver builds its n values without reading n maps key by key
(see broker/PROTOCOL.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from broker.delivery.values import (
    MESSAGE_FIELDS,
    Delivery,
    DeliveryColumns,
    MessageColumns,
    OutgoingMessage,
    columns_of,
    field_defaults,
    field_names,
    many,
)
from broker.protocol.errors import MalformedFrameError

T = TypeVar("T")
Table = dict[str, Any]


_SEQUENCES = (list, tuple)  # msgpack gives lists; tables made in this process hold tuples
_OWN = frozenset({"body", "receipt", "offset", "message_id"})  # one per message: always a column


def table(rows: Sequence[Any], names: Sequence[str]) -> Table:
    """The ``names`` attributes of ``rows`` as a table (mappings become plain dicts for msgpack)."""
    count = len(rows)
    same: dict[str, Any] = {}
    columns: dict[str, Sequence[Any]] = {}
    transposed = columns_of(rows, names)
    for name, column in zip(names, transposed):
        if name == "headers" and set(map(type, column)) - {dict}:
            column = tuple(map(dict, column))
        if count and name not in _OWN and column.count(column[0]) == count:
            same[name] = column[0]
        else:
            columns[name] = column
    return {"count": count, "same": same, "columns": columns}


def column_table(count: int, same: Mapping[str, Any], columns: Mapping[str, Sequence[Any]]) -> Table:
    """Values already column by column (a fetch's `DeliveryColumns`) as a table: a column whose
    values are all equal moves to ``same`` (except the fields of `_OWN`), headers become plain
    dicts for msgpack."""
    carried_same = {name: dict(value) if name == "headers" else value for name, value in same.items()}
    carried: dict[str, Sequence[Any]] = {}
    for name, column in columns.items():
        if count and name not in _OWN and column.count(column[0]) == count:
            carried_same[name] = dict(column[0]) if name == "headers" else column[0]
        elif name == "headers" and set(map(type, column)) - {dict}:
            carried[name] = list(map(dict, column))
        else:
            carried[name] = column
    return {"count": count, "same": carried_same, "columns": carried}


def rows(kind: type[T], carried: Any, where: str) -> list[T]:
    """The instances of the frozen dataclass ``kind`` that ``carried`` holds, fields left out at
    their defaults (built by `broker.delivery.values.many`, without an ``__init__`` per row); a
    `MalformedFrameError` naming ``where`` unless it is such a table. The values are not
    type-checked here (see `checked_messages`)."""
    count, same, columns = _parts(carried, where)
    if count == 0:
        return []
    return many(kind, count, {**_defaults(kind, set(same) | set(columns), where), **same}, columns)


def delivery_columns(carried: Any, where: str) -> DeliveryColumns:
    """The deliveries ``carried`` holds as `DeliveryColumns` (a read's reply), fields left out at
    their defaults, without a `Delivery` per message; a `MalformedFrameError` naming ``where``
    unless it is such a table."""
    count, same, columns = _parts(carried, where)
    if count == 0:
        return DeliveryColumns(0, {}, {})
    return DeliveryColumns(count, {**_defaults(Delivery, set(same) | set(columns), where), **same}, columns)


def outgoing_table(messages: Sequence[OutgoingMessage], message_ids: list[str] | None) -> Table:
    """A publish's messages, with these ids (None: none, a batch id names them); fields at
    their default for every message are left out."""
    carried = table(messages, [name for name in MESSAGE_FIELDS if name != "message_id"])
    for name, default in _EMPTY.items():
        if name in carried["same"] and carried["same"][name] == default:
            del carried["same"][name]
    if message_ids is not None:
        carried["columns"]["message_id"] = message_ids
    return carried


def checked_messages(carried: Any, where: str) -> list[OutgoingMessage]:
    """The messages of a publish request, every value of the right type (a client's bytes)."""
    return checked_columns(carried, where).messages()


def checked_columns(carried: Any, where: str) -> MessageColumns:
    """`checked_messages` column by column: every field in ``same`` or ``columns``, those left
    out at their defaults, without an `OutgoingMessage` per message."""
    count, same, columns = _parts(carried, where)
    for name in set(same) | set(columns):
        check = _CHECKS.get(name)
        values = columns[name] if name in columns else [same[name]]
        if check is None or not check(values):
            raise MalformedFrameError(f"{where}: field {name!r} must be {_EXPECTED.get(name, 'absent')}")
    if count and "body" not in same and "body" not in columns:
        raise MalformedFrameError(f"{where}: field 'body' is required")
    if "deliver_at" in columns:  # a number: ints become floats
        columns["deliver_at"] = list(map(float, columns["deliver_at"]))
    elif "deliver_at" in same:
        same["deliver_at"] = float(same["deliver_at"])
    if count == 0:
        return MessageColumns(0, {}, {})
    return MessageColumns(count, {**_defaults(OutgoingMessage, set(same) | set(columns), where), **same},
                          columns)


def _parts(carried: Any, where: str) -> tuple[int, dict[str, Any], dict[str, Sequence[Any]]]:
    if not (isinstance(carried, dict) and set(carried) == {"count", "same", "columns"}):
        raise MalformedFrameError(f"{where} must be a map of count, same and columns")
    count, same, columns = carried["count"], carried["same"], carried["columns"]
    if not (type(count) is int and count >= 0 and isinstance(same, dict) and isinstance(columns, dict)):
        raise MalformedFrameError(f"{where}: count must be an int >= 0, same and columns maps")
    if set(same) & set(columns):
        raise MalformedFrameError(f"{where}: fields {sorted(set(same) & set(columns))} are in same and columns")
    if not all(type(column) in _SEQUENCES and len(column) == count for column in columns.values()):
        raise MalformedFrameError(f"{where}: every column must be a list of {count} values")
    return count, same, columns


def _defaults(kind: type, given: set[str], where: str) -> dict[str, Any]:
    """The values of the fields of ``kind`` not ``given``; an error if one has no default or a
    given name is no field."""
    names, defaults = field_names(kind), field_defaults(kind)
    unknown = given - set(names)
    missing = [name for name in names if name not in given and name not in defaults]
    if unknown or missing:
        raise MalformedFrameError(f"{where}: unknown fields {sorted(unknown)}, missing {missing}")
    return {name: value for name, value in defaults.items() if name not in given}


def _all_of(*kinds: type) -> Callable[[Sequence[Any]], bool]:
    allowed = set(kinds)
    return lambda values: set(map(type, values)) <= allowed


def _headers(values: Sequence[Any]) -> bool:
    return all(type(h) is dict and all(type(k) is str and type(v) is str for k, v in h.items())
               for h in values)


_CHECKS: dict[str, Callable[[Sequence[Any]], bool]] = {
    "body": _all_of(bytes), "key": _all_of(str), "tag": _all_of(str), "message_id": _all_of(str),
    "headers": _headers, "queue": _all_of(int, type(None)), "deliver_at": _all_of(int, float),
}
_EXPECTED = {"body": "bytes", "key": "str", "tag": "str", "message_id": "str",
             "headers": "a map of str to str", "queue": "int or nil", "deliver_at": "a number"}
_EMPTY: Mapping[str, Any] = {"key": "", "tag": "", "headers": {}, "queue": None, "deliver_at": 0.0}
