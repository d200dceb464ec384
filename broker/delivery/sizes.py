"""How many bytes a delivery holds: its body, message id, key, tag and headers, in UTF-8.

The bounds on what is out unacknowledged (``max_unacked_bytes``) and on what one fetch hands out
(``max_fetch_bytes``) count this, the record's variable part as the store and the wire carry it.
They counted bodies alone, so a client publishing tiny bodies with large headers or keys (each up
to the frame size) made the server hold many times the bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import add
from typing import TYPE_CHECKING

from broker.delivery.values import NO_HEADERS, Columns, Delivery

if TYPE_CHECKING:  # the store's package imports the engine's, structlog and more: a Spark source's
    from broker.store.record import StoredBatch  # offsets process must not pay for them

TEXT_FIELDS = ("message_id", "key", "tag")


def text_bytes(text: str) -> int:
    """``text``'s length in UTF-8 (``isascii`` reads a flag CPython keeps: ASCII is not encoded)."""
    return len(text) if text.isascii() else len(text.encode())


def headers_bytes(headers: Mapping[str, str]) -> int:
    """The bytes of ``headers``' names and values."""
    return sum(text_bytes(name) + text_bytes(value) for name, value in headers.items()) if headers else 0


def _text_sizes(column: Sequence[str]) -> Iterable[int]:
    return map(len, column) if "".join(column).isascii() else map(text_bytes, column)


def record_sizes(bodies: Sequence[bytes], texts: Iterable[Sequence[str]],
                 headers: Sequence[Mapping[str, str]] | None) -> list[int]:
    """The bytes of each record of a column of ``bodies``, columns of ``texts`` (message id,
    key, tag) and one of ``headers`` (None: none has any); a mapping that many records share
    is measured once."""
    sizes = list(map(len, bodies))
    for column in texts:
        if any(column):
            sizes = list(map(add, sizes, _text_sizes(column)))
    if headers is not None and headers and headers.count(headers[0]) == len(headers):  # one for all
        same = headers_bytes(headers[0])
        return [size + same for size in sizes] if same else sizes
    if headers is not None and any(headers):
        ids = list(map(id, headers))  # decoded once per distinct encoding: few distinct mappings
        measured = {ident: headers_bytes(mapping) for ident, mapping in dict(zip(ids, headers)).items()}
        sizes = list(map(add, sizes, map(measured.__getitem__, ids)))
    return sizes


def column_sizes(deliveries: Columns) -> list[int]:
    """The bytes of each of ``deliveries`` (a fetch's columns): what `record_sizes` counts."""
    same, columns = deliveries.same, deliveries.columns
    extra = sum(text_bytes(same.get(name, "")) for name in TEXT_FIELDS if name not in columns)
    extra += 0 if "headers" in columns else headers_bytes(same.get("headers", NO_HEADERS))
    sizes = record_sizes(deliveries.column("body"), [columns[name] for name in TEXT_FIELDS if name in columns],
                         columns.get("headers"))
    return [size + extra for size in sizes] if extra else sizes


def delivery_size(delivery: Delivery) -> int:
    """The bytes of one delivery (as `record_sizes` counts each)."""
    return (len(delivery.body) + text_bytes(delivery.message_id) + text_bytes(delivery.key)
            + text_bytes(delivery.tag) + headers_bytes(delivery.headers))


def stored_bytes(batch: StoredBatch) -> int:
    """The bytes of a batch read from the store (as `record_sizes` counts each)."""
    return sum(record_sizes(batch.bodies, (batch.message_ids, batch.keys, batch.tags), batch.headers))
