"""The executor-side row pipeline: one row per token, new tokens only, validated rows.

`RowPipeline` is the function given to ``mapInArrow`` after the batch was
repartitioned by token (so every copy of a token reaches the same task). For
each Arrow record batch it

1. sets aside rows without a token (poison: `TokenMissingError`);
2. keeps the first row of each token seen by the task (duplicates in the batch);
3. drops rows whose token the cache or store already knows (`KnownTokens`);
4. runs the optional per-row ``validate`` step; a row that raises is poison.

Good rows and poison rows leave in one output, told apart by marker columns
(the token, and for poison the error and the row as JSON), so the driver can
cache the result once and read both without computing the batch twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from reliable.errors import TokenMissingError
from reliable.spark.deadletters import row_json
from reliable.spark.tokens import KnownTokens

TOKEN = "_reliable_token"
ERROR_TYPE = "_reliable_error_type"
ERROR = "_reliable_error"
ROW_JSON = "_reliable_row"
MARKERS = (TOKEN, ERROR_TYPE, ERROR, ROW_JSON)

Validate = Callable[[dict[str, Any]], Mapping[str, Any]]
"""A per-row step: the row as a dict in, the row to write out; raising makes the row poison."""


@dataclass(frozen=True)
class _Poison:
    token: str | None
    row: Mapping[str, Any]
    error: BaseException


@dataclass(frozen=True)
class RowPipeline:
    """``mapInArrow`` function: record batches in, good rows and poison rows (marked) out.

    ``schema`` is the Arrow schema of the output: the data columns followed by
    the `MARKERS`.
    """

    token: str
    known: KnownTokens
    schema: pa.Schema
    validate: Validate | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        seen: set[str] = set()  # tokens this task has already passed on or dropped
        for batch in batches:
            yield from self._process(batch, seen)

    def _process(self, batch: pa.RecordBatch, seen: set[str]) -> Iterator[pa.RecordBatch]:
        first: list[tuple[int, str]] = []
        poison: list[_Poison] = []
        for index, value in enumerate(batch.column(self.token).to_pylist()):
            if value is None:
                error = TokenMissingError(f"the token column {self.token!r} is null")
                poison.append(_Poison(None, _row(batch, index), error))
                continue
            token = str(value)
            if token not in seen:
                seen.add(token)
                first.append((index, token))
        fresh = self.known.new([token for _, token in first]) if first else set()
        keep = [(index, token) for index, token in first if token in fresh]
        if keep:
            good, refused = self._use(batch, keep)
            poison.extend(refused)
            if good is not None:
                yield good
        if poison:
            yield self._poison_batch(poison)

    def _use(
        self, batch: pa.RecordBatch, keep: list[tuple[int, str]]
    ) -> tuple[pa.RecordBatch | None, list[_Poison]]:
        rows = batch.take(pa.array([index for index, _ in keep], pa.int64()))
        tokens = [token for _, token in keep]
        if self.validate is None:
            columns = [rows.column(field.name) for field in self._data_fields()]
            return self._good_batch(columns, tokens), []
        return self._validated(rows.to_pylist(), tokens)

    def _validated(
        self, rows: list[dict[str, Any]], tokens: list[str]
    ) -> tuple[pa.RecordBatch | None, list[_Poison]]:
        assert self.validate is not None
        good: list[Mapping[str, Any]] = []
        good_tokens: list[str] = []
        poison: list[_Poison] = []
        for row, token in zip(rows, tokens, strict=True):
            try:
                out = self.validate(dict(row))
                if not isinstance(out, Mapping):
                    raise TypeError(f"validate returned {type(out).__name__}, expected a mapping")
            except Exception as exc:  # noqa: BLE001 - any error makes the row poison, not the batch
                poison.append(_Poison(token, row, exc))
                continue
            good.append(out)
            good_tokens.append(token)
        if not good:
            return None, poison
        data = pa.schema(self._data_fields())
        try:
            table = pa.Table.from_pylist(good, schema=data)
        except (pa.ArrowException, TypeError, ValueError):  # find the rows Arrow refuses
            table, good_tokens, refused = _convert_each(good, good_tokens, rows, tokens, data)
            poison.extend(refused)
        if table.num_rows == 0:
            return None, poison
        columns = [table.column(i).combine_chunks() for i in range(table.num_columns)]
        return self._good_batch(columns, good_tokens), poison

    def _data_fields(self) -> list[pa.Field]:
        return [field for field in self.schema if field.name not in MARKERS]

    def _good_batch(self, columns: list[pa.Array], tokens: list[str]) -> pa.RecordBatch:
        none = pa.nulls(len(tokens), pa.string())
        arrays = [*columns, pa.array(tokens, pa.string()), none, none, none]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _poison_batch(self, poison: list[_Poison]) -> pa.RecordBatch:
        n = len(poison)
        arrays = [pa.nulls(n, field.type) for field in self._data_fields()]
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
    good: list[Mapping[str, Any]],
    good_tokens: list[str],
    rows: list[dict[str, Any]],
    tokens: list[str],
    schema: pa.Schema,
) -> tuple[pa.Table, list[str], list[_Poison]]:
    """Convert validated rows one by one; a row Arrow cannot hold in ``schema`` is poison."""
    originals = {token: row for row, token in zip(rows, tokens, strict=True)}
    tables: list[pa.Table] = []
    kept: list[str] = []
    refused: list[_Poison] = []
    for out, token in zip(good, good_tokens, strict=True):
        try:
            tables.append(pa.Table.from_pylist([out], schema=schema))
            kept.append(token)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            refused.append(_Poison(token, originals[token], exc))
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    return table, kept, refused
