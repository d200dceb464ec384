"""The source's rows as Arrow: a broker read's columns become one `pyarrow.RecordBatch`.

Spark's Python Data Source API hands a reader's `pyarrow.RecordBatch`es to the
JVM as they are; a reader yielding tuples pays a Python conversion per field of
every row. The broker reads column by column (`BrokerApi.read_columns`), so a
batch is built from a few long lists, each converted in C: no Python object per
row on the way. A field the broker sends once for every row (the topic, the
headers of a batch published together) is spread by Arrow, not by a list.

``json`` is the body as text where the ``content-type`` header says JSON (found
with Arrow's map lookup): Spark's own ``from_json`` parses it (see docs/spark.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from backends.types import CONTENT_TYPE, JSON

# One declaration: the Spark schema (DDL) and the Arrow schema Spark checks batches against.
COLUMNS: tuple[tuple[str, str, pa.DataType], ...] = (
    ("topic", "string", pa.string()),
    ("queue", "int", pa.int32()),
    ("offset", "long", pa.int64()),
    ("message_id", "string", pa.string()),
    ("key", "string", pa.string()),
    ("tag", "string", pa.string()),
    ("headers", "map<string,string>", pa.map_(pa.string(), pa.string())),
    ("body", "binary", pa.binary()),
    ("json", "string", pa.string()),
    ("published_at", "timestamp", pa.timestamp("us", tz="UTC")),
    ("delivery_count", "int", pa.int32()),
)
SCHEMA = ", ".join(f"{name} {ddl}" for name, ddl, _ in COLUMNS)
ARROW_SCHEMA = pa.schema([(name, kind) for name, _, kind in COLUMNS])
_TYPES = {name: kind for name, _, kind in COLUMNS}
_EMPTY_IS_NULL = frozenset({"key", "tag"})  # the broker's "" is the row's null


def record_batch(count: int, same: dict[str, Any], columns: dict[str, Any]) -> pa.RecordBatch:
    """The deliveries of a read (`DeliveryColumns`' parts) as a batch of `ARROW_SCHEMA`."""
    values = {name: _array(name, count, same, columns) for name in _TYPES if name != "json"}
    values["json"] = json_text(values["headers"], values["body"], same.get("headers"))
    return pa.RecordBatch.from_arrays([values[name] for name in _TYPES], schema=ARROW_SCHEMA)


def json_text(headers: pa.MapArray, body: pa.Array, same: dict[str, str] | None = None) -> pa.Array:
    """The bodies as text where the content type says JSON, null elsewhere (``same``: the
    headers of every row, when the read found them all equal)."""
    if same is not None:
        if same.get(CONTENT_TYPE, "").startswith(JSON):
            return _text(body)
        return pa.nulls(len(body), pa.string())
    content_type = pc.map_lookup(headers, pa.scalar(CONTENT_TYPE), "first")
    is_json = pc.fill_null(pc.starts_with(content_type, pattern=JSON), False)
    if not pc.any(is_json).as_py():
        return pa.nulls(len(body), pa.string())
    return pc.if_else(is_json, _text(body), pa.scalar(None, pa.string()))


def _text(body: pa.Array) -> pa.Array:
    """``body`` as UTF-8 text; a body that is not UTF-8 becomes null (it cannot be JSON)."""
    try:
        return body.cast(pa.string())  # checked in C
    except pa.ArrowInvalid:  # rare: only then a look at each body
        return pa.array([_decoded(b) for b in body.to_pylist()], pa.string())


def _decoded(body: bytes | None) -> str | None:
    try:
        return None if body is None else body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _array(name: str, count: int, same: dict[str, Any], columns: dict[str, Any]) -> pa.Array:
    kind = _TYPES[name]
    if name == "published_at":  # seconds (float) -> microseconds
        if name not in columns:
            return pa.repeat(pa.scalar(round(same[name] * 1_000_000), kind), count)
        return pa.array(np.round(np.asarray(columns[name], np.float64) * 1_000_000).astype(np.int64)).cast(kind)
    if name not in columns:
        value = same[name]
        if name == "headers":
            return _spread(pa.array([dict(value)], kind), count)
        if name in _EMPTY_IS_NULL and value == "":
            return pa.nulls(count, kind)
        return pa.repeat(pa.scalar(value, kind), count)
    column = columns[name]
    if name == "headers":
        return pa.array(column if isinstance(column[0], dict) else list(map(dict, column)), kind)
    array = pa.array(column, kind)
    if name in _EMPTY_IS_NULL:
        return pc.if_else(pc.equal(array, ""), pa.scalar(None, kind), array)
    return array


def _spread(one: pa.Array, count: int) -> pa.Array:
    """The one value of ``one`` repeated ``count`` times, in C (no list per row)."""
    return one.take(pa.array(np.zeros(count, np.int32)))
