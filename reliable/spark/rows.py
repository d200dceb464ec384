"""The executor-side row pipeline: one row per token, new tokens only, validated rows.

`RowPipeline` is the function given to ``mapInArrow``; each task runs it over
its partition of the micro-batch, without a shuffle. For each Arrow record
batch it

1. sets aside rows without a token (poison: `TokenMissingError`);
2. keeps the first row of each token seen by the task (duplicates in the task);
3. drops rows whose token the shared cache already knows (`CachedTokens`, when
   the app has a Redis cache; the driver's claim finds the rest);
4. runs the optional per-row ``validate`` step; a row that raises is poison.

Every row that leaves gets a row id unique in the batch (partition id and
position), so the driver can keep one row of a token that several tasks
passed on. Good rows and poison rows leave in one output, told apart by
marker columns (the token, the row id, and for poison the error and the row
as JSON), so the driver caches the result once and reads both from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from reliable.errors import TokenMissingError
from reliable.spark.deadletters import row_json
from reliable.spark.tokens import CachedTokens

TOKEN = "_reliable_token"
ROW_ID = "_reliable_row_id"
ERROR_TYPE = "_reliable_error_type"
ERROR = "_reliable_error"
ROW_JSON = "_reliable_row"
MARKERS = (TOKEN, ROW_ID, ERROR_TYPE, ERROR, ROW_JSON)
PARTITION_SHIFT = 40  # row id = partition id << 40 | position of the row in its partition

Validate = Callable[[dict[str, Any]], Mapping[str, Any]]
"""A per-row step: the row as a dict in, the row to write out; raising makes the row poison."""

Key = tuple[str, int]  # (token, row id)


@dataclass(frozen=True)
class _Poison:
    token: str | None
    row_id: int
    row: Mapping[str, Any]
    error: BaseException


@dataclass
class _Task:
    """What one task remembers across the record batches of its partition."""

    base: int
    offset: int = 0
    seen: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class RowPipeline:
    """``mapInArrow`` function: record batches in, good rows and poison rows (marked) out.

    ``schema`` is the Arrow schema of the output: the data columns followed by
    the `MARKERS`.
    """

    token: str
    schema: pa.Schema
    cached: CachedTokens | None = None
    validate: Validate | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        task = _Task(base=(context.partitionId() if context else 0) << PARTITION_SHIFT)
        for batch in batches:
            yield from self._process(batch, task)
            task.offset += batch.num_rows

    def _process(self, batch: pa.RecordBatch, task: _Task) -> Iterator[pa.RecordBatch]:
        first: list[tuple[int, str]] = []
        poison: list[_Poison] = []
        for index, value in enumerate(batch.column(self.token).to_pylist()):
            if value is None:
                error = TokenMissingError(f"the token column {self.token!r} is null")
                poison.append(
                    _Poison(None, task.base + task.offset + index, _row(batch, index), error)
                )
                continue
            token = str(value)
            if token not in task.seen:
                task.seen.add(token)
                first.append((index, token))
        keep = first
        if self.cached is not None and first:
            fresh = self.cached.new([token for _, token in first])
            keep = [(index, token) for index, token in first if token in fresh]
        if keep:
            good, refused = self._use(batch, keep, task.base + task.offset)
            poison.extend(refused)
            if good is not None:
                yield good
        if poison:
            yield self._poison_batch(poison)

    def _use(
        self, batch: pa.RecordBatch, keep: list[tuple[int, str]], first_id: int
    ) -> tuple[pa.RecordBatch | None, list[_Poison]]:
        rows = batch.take(pa.array([index for index, _ in keep], pa.int64()))
        keys = [(token, first_id + index) for index, token in keep]
        if self.validate is None:
            columns = [rows.column(f.name) for f in self._data_fields()]
            return self._good_batch(columns, keys), []
        return self._validated(rows.to_pylist(), keys)

    def _validated(
        self, rows: list[dict[str, Any]], keys: list[Key]
    ) -> tuple[pa.RecordBatch | None, list[_Poison]]:
        assert self.validate is not None
        good: list[tuple[Mapping[str, Any], Key, dict[str, Any]]] = []
        poison: list[_Poison] = []
        for row, key in zip(rows, keys, strict=True):
            try:
                out = self.validate(dict(row))
                if not isinstance(out, Mapping):
                    raise TypeError(f"validate returned {type(out).__name__}, expected a mapping")
            except Exception as exc:  # noqa: BLE001 - any error makes the row poison, not the batch
                poison.append(_Poison(key[0], key[1], row, exc))
                continue
            good.append((out, key, row))
        data = pa.schema(self._data_fields())
        try:
            table = pa.Table.from_pylist([out for out, _, _ in good], schema=data)
        except (pa.ArrowException, TypeError, ValueError):  # find the rows Arrow refuses
            table, good, refused = _convert_each(good, data)
            poison.extend(refused)
        if table.num_rows == 0:
            return None, poison
        columns = [table.column(i).combine_chunks() for i in range(table.num_columns)]
        return self._good_batch(columns, [key for _, key, _ in good]), poison

    def _data_fields(self) -> list[pa.Field]:
        return [f for f in self.schema if f.name not in MARKERS]

    def _good_batch(self, columns: list[pa.Array], keys: list[Key]) -> pa.RecordBatch:
        none = pa.nulls(len(keys), pa.string())
        tokens = pa.array([token for token, _ in keys], pa.string())
        ids = pa.array([row_id for _, row_id in keys], pa.int64())
        return pa.RecordBatch.from_arrays(
            [*columns, tokens, ids, none, none, none], schema=self.schema
        )

    def _poison_batch(self, poison: list[_Poison]) -> pa.RecordBatch:
        n = len(poison)
        arrays = [pa.nulls(n, f.type) for f in self._data_fields()]
        arrays += [
            pa.array([p.token for p in poison], pa.string()),
            pa.array([p.row_id for p in poison], pa.int64()),
            pa.array([type(p.error).__name__ for p in poison], pa.string()),
            pa.array([str(p.error) for p in poison], pa.string()),
            pa.array([row_json(p.row) for p in poison], pa.string()),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _row(batch: pa.RecordBatch, index: int) -> dict[str, Any]:
    return batch.slice(index, 1).to_pylist()[0]


def _convert_each(
    good: list[tuple[Mapping[str, Any], Key, dict[str, Any]]], schema: pa.Schema
) -> tuple[pa.Table, list[tuple[Mapping[str, Any], Key, dict[str, Any]]], list[_Poison]]:
    """Convert validated rows one by one; a row Arrow cannot hold in ``schema`` is poison."""
    tables: list[pa.Table] = []
    kept: list[tuple[Mapping[str, Any], Key, dict[str, Any]]] = []
    refused: list[_Poison] = []
    for out, key, row in good:
        try:
            tables.append(pa.Table.from_pylist([out], schema=schema))
            kept.append((out, key, row))
        except (pa.ArrowException, TypeError, ValueError) as exc:
            refused.append(_Poison(key[0], key[1], row, exc))
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    return table, kept, refused
