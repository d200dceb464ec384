"""The executor-side ``validate`` step: one row per token, validated, poison set aside.

Every row of a batch is first marked on the JVM side (`batch.prepare`) with
its token (the token column cast to a string). Without a ``validate`` step
that is all; with one, `RowPipeline` is the function given to ``mapInArrow``
and each task runs it over its partition, without a shuffle. For each Arrow
record batch it

1. sets aside rows without a token, or with one the store cannot record
   (poison: `TokenMissingError`, `TokenInvalidError`);
2. keeps the first row of each token seen by the task (copies that other
   tasks passed on are dropped later, by token);
3. runs ``validate`` on each kept row; a row that raises is poison.

Good rows and poison rows leave in one output, told apart by marker columns
(for poison the error and the row as JSON), so the driver caches the result
once and reads both from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from reliable.errors import ReliableError, TokenInvalidError, TokenMissingError
from reliable.idempotency import unrecordable
from reliable.spark.deadletters import row_json

TOKEN = "_reliable_token"
ERROR_TYPE = "_reliable_error_type"
ERROR = "_reliable_error"
ROW_JSON = "_reliable_row"
MARKERS = (TOKEN, ERROR_TYPE, ERROR, ROW_JSON)

Validate = Callable[[dict[str, Any]], Mapping[str, Any]]
"""A per-row step: the row as a dict in, the row to write out; raising makes the row poison."""


def token_problem(token: str | None, column: str) -> ReliableError | None:
    """Why a row with ``token`` (its token column as a string) is poison, or None: the column is
    null, or holds a token the store cannot record (`reliable.idempotency.unrecordable`)."""
    if token is None:
        return TokenMissingError(f"the token column {column!r} is null")
    if problem := unrecordable(token):
        return TokenInvalidError(f"the token column {column!r} {problem}")
    return None


@dataclass(frozen=True)
class _Poison:
    token: str | None
    row: Mapping[str, Any]
    error: BaseException


@dataclass(frozen=True)
class RowPipeline:
    """``mapInArrow`` function: marked record batches in, good and poison rows (marked) out.

    The input holds the data columns followed by `TOKEN`;
    ``schema`` is the Arrow schema of the output: the validated data columns
    followed by the `MARKERS`.
    """

    token: str  # the token column's name, for error messages
    schema: pa.Schema
    validate: Validate

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        seen: set[str] = set()  # tokens this task has passed on
        for batch in batches:
            yield from self._process(batch, seen)

    def _process(self, batch: pa.RecordBatch, seen: set[str]) -> Iterator[pa.RecordBatch]:
        data = batch.select([name for name in batch.schema.names if name != TOKEN])
        keep: list[int] = []
        tokens: list[str] = []
        poison: list[_Poison] = []
        for index, token in enumerate(batch.column(TOKEN).to_pylist()):
            if problem := token_problem(token, self.token):  # recorded without the token
                poison.append(_Poison(None, _row(data, index), problem))
            elif token not in seen:
                seen.add(token)
                keep.append(index)
                tokens.append(token)
        if keep:
            rows = data.take(pa.array(keep, pa.int64())).to_pylist()
            good, refused = self._validated(rows, tokens)
            poison.extend(refused)
            if good is not None:
                yield good
        if poison:
            yield self._poison_batch(poison)

    def _validated(
        self, rows: list[dict[str, Any]], tokens: list[str]
    ) -> tuple[pa.RecordBatch | None, list[_Poison]]:
        good: list[tuple[Mapping[str, Any], str, dict[str, Any]]] = []
        poison: list[_Poison] = []
        for row, token in zip(rows, tokens, strict=True):
            try:
                out = self.validate(dict(row))
                if not isinstance(out, Mapping):
                    raise TypeError(f"validate returned {type(out).__name__}, expected a mapping")
            except Exception as exc:  # noqa: BLE001 - any error makes the row poison, not the batch
                poison.append(_Poison(token, row, exc))
                continue
            good.append((out, token, row))
        data = pa.schema(self._data_fields())
        try:
            table = pa.Table.from_pylist([out for out, _, _ in good], schema=data)
        except (pa.ArrowException, TypeError, ValueError):  # find the rows Arrow refuses
            table, good, refused = _convert_each(good, data)
            poison.extend(refused)
        if table.num_rows == 0:
            return None, poison
        columns = [table.column(i).combine_chunks() for i in range(table.num_columns)]
        return self._good_batch(columns, [token for _, token, _ in good]), poison

    def _data_fields(self) -> list[pa.Field]:
        return [f for f in self.schema if f.name not in MARKERS]

    def _good_batch(self, columns: list[pa.Array], tokens: list[str]) -> pa.RecordBatch:
        none = pa.nulls(len(tokens), pa.string())
        marked = [*columns, pa.array(tokens, pa.string()), none, none, none]
        return pa.RecordBatch.from_arrays(marked, schema=self.schema)

    def _poison_batch(self, poison: list[_Poison]) -> pa.RecordBatch:
        n = len(poison)
        arrays = [pa.nulls(n, f.type) for f in self._data_fields()]
        arrays += [
            pa.array([p.token for p in poison], pa.string()),
            pa.array([type(p.error).__name__ for p in poison], pa.string()),
            pa.array([str(p.error) for p in poison], pa.string()),
            pa.array([row_json(p.row) for p in poison], pa.string()),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _row(batch: pa.RecordBatch, index: int) -> dict[str, Any]:
    return batch.slice(index, 1).to_pylist()[0]


def _convert_each(
    good: list[tuple[Mapping[str, Any], str, dict[str, Any]]], schema: pa.Schema
) -> tuple[pa.Table, list[tuple[Mapping[str, Any], str, dict[str, Any]]], list[_Poison]]:
    """Convert validated rows one by one; a row Arrow cannot hold in ``schema`` is poison."""
    tables: list[pa.Table] = []
    kept: list[tuple[Mapping[str, Any], str, dict[str, Any]]] = []
    refused: list[_Poison] = []
    for out, token, row in good:
        try:
            tables.append(pa.Table.from_pylist([out], schema=schema))
            kept.append((out, token, row))
        except (pa.ArrowException, TypeError, ValueError) as exc:
            refused.append(_Poison(token, row, exc))
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    return table, kept, refused
