"""The driver's view of one micro-batch after the executors prepared it.

`prepare` marks every row on the executors (token and row id; with a
``validate`` step, the `RowPipeline` through ``mapInArrow``, no shuffle) and
caches the result, then collects only what the driver needs for the batch
transaction: the tokens and row ids of the good rows and the poison rows.
A token several rows hold keeps its first row (lowest row id); the other
copies are dropped. `PreparedBatch.rows` hands the user's
function the good rows whose tokens the transaction actually claimed; the
rows themselves never leave the executors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import LongType, StringType, StructField, StructType

from backends.errors import ConfigurationError
from reliable.spark.deadletters import row_json
from reliable.spark.rows import (
    ERROR,
    ERROR_TYPE,
    MARKERS,
    ROW_ID,
    ROW_JSON,
    TOKEN,
    RowPipeline,
    Validate,
    missing_token,
)

ISIN_LIMIT = 1_000  # values filtered with IN (...); more go through a broadcast anti-join

BatchFunction = Callable[[DataFrame, int, Any], Any]
"""The user's function: the batch's new, valid rows, the batch id and the store transaction."""


@dataclass
class PreparedBatch:
    """A batch de-duplicated and validated on the executors, cached until `release`."""

    frame: DataFrame
    tokens: list[str]
    poison: list[dict[str, Any]] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)  # row ids of duplicate copies to drop

    def rows(self, claimed: set[str] | None = None) -> DataFrame:
        """The good rows, without the markers; only those whose token is in ``claimed`` if given.

        A token the claim did not get was already recorded (by an earlier
        batch, or a concurrent writer): its row is dropped.
        """
        return self._good(claimed).drop(*MARKERS)

    def collect_rows(self) -> list[tuple[str, dict[str, Any]]]:
        """Every good row with its token, on the driver (only for dead-lettering a whole batch)."""
        table = self._good(None).drop(ROW_ID, ERROR_TYPE, ERROR, ROW_JSON).toArrow()
        tokens = table.column(TOKEN).to_pylist()
        return list(zip(tokens, table.drop_columns([TOKEN]).to_pylist(), strict=True))

    def release(self) -> None:
        """Drop the cached rows."""
        self.frame.unpersist()

    def _good(self, claimed: set[str] | None) -> DataFrame:
        good = self.frame.where(F.col(ERROR_TYPE).isNull())
        if claimed is not None and len(claimed) < len(self.tokens):
            known = [t for t in self.tokens if t not in claimed]
            if len(claimed) < len(known):  # fewer rows to keep than to drop: select those
                good = _matching(good, TOKEN, sorted(claimed), pa.string(), keep=True)
            else:
                good = _matching(good, TOKEN, known, pa.string(), keep=False)
        return _matching(good, ROW_ID, self.copies, pa.int64(), keep=False)


def prepare(
    df: DataFrame,
    *,
    token: str,
    validate: Validate | None = None,
    schema: StructType | None = None,
) -> PreparedBatch:
    """Mark (and validate) the rows on the executors; collect tokens, duplicate copies and poison.

    Every row gets its token (the column cast to a string) and a row id unique
    in the batch, on the JVM side. Without ``validate`` the rows never leave
    the JVM; with it they go through `RowPipeline` (``mapInArrow``).
    """
    if token not in df.columns:
        raise ConfigurationError(
            f"token={token!r} is not a column of the batch; columns: {', '.join(df.columns)}"
        )
    output_schema(df.schema)  # refuses data columns named like the markers
    marked = df.select("*", df[token].cast("string").alias(TOKEN),
                       F.monotonically_increasing_id().alias(ROW_ID))  # fmt: skip
    if validate is None:
        missing, error = F.col(TOKEN).isNull(), missing_token(token)
        frame = marked.select("*", F.when(missing, F.lit(type(error).__name__)).alias(ERROR_TYPE),
                              F.when(missing, F.lit(str(error))).alias(ERROR),
                              F.lit(None).cast("string").alias(ROW_JSON))  # fmt: skip
    else:
        output = output_schema(schema if schema is not None else df.schema)
        timezone = df.sparkSession.conf.get("spark.sql.session.timeZone")
        pipeline = RowPipeline(token, to_arrow_schema(output, timezone=timezone), validate)
        frame = marked.mapInArrow(pipeline, output)
    frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        markers = frame.select(TOKEN, ROW_ID, ERROR_TYPE, ERROR, ROW_JSON).toArrow()
        is_good = pc.is_null(markers.column(ERROR_TYPE))
        tokens, copies = _first_rows(markers.filter(is_good).select([TOKEN, ROW_ID]))
        poison = markers.filter(pc.invert(is_good)).to_pylist()
        if validate is None and poison:  # rows without a token: their JSON, made here
            poison = _with_rows(frame, poison)
    except BaseException:
        frame.unpersist()
        raise
    return PreparedBatch(frame, tokens, _one_per_token(poison, set(tokens)), copies)


def _with_rows(frame: DataFrame, poison: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Poison markers with their rows as JSON (collected: only the poison rows)."""
    table = frame.where(F.col(ERROR_TYPE).isNotNull()).drop(TOKEN, ERROR_TYPE, ERROR, ROW_JSON)
    rows = {row.pop(ROW_ID): row for row in table.toArrow().to_pylist()}
    return [{**marker, ROW_JSON: row_json(rows[marker[ROW_ID]])} for marker in poison]


def _one_per_token(rows: list[dict[str, Any]], good: set[str]) -> list[dict[str, Any]]:
    """Poison rows as dead-letter fields: one per token, none for a token another task passed."""
    kept: list[dict[str, Any]] = []
    for row in rows:
        token = row[TOKEN]
        if token is not None:
            if token in good:
                continue
            good.add(token)
        kept.append({"token": token, "row_json": row[ROW_JSON], "error_type": row[ERROR_TYPE],
                     "error_message": row[ERROR]})  # fmt: skip
    return kept


def _first_rows(good: pa.Table) -> tuple[list[str], list[int]]:
    """The distinct tokens, and the row ids of every copy but the first of a token."""
    firsts = good.group_by(TOKEN).aggregate([(ROW_ID, "min")])
    if firsts.num_rows == good.num_rows:  # no token came from two tasks
        return good.column(TOKEN).to_pylist(), []
    keep = firsts.column(f"{ROW_ID}_min")
    copies = good.filter(pc.invert(pc.is_in(good.column(ROW_ID), value_set=keep)))
    return firsts.column(TOKEN).to_pylist(), copies.column(ROW_ID).to_pylist()


def _matching(
    frame: DataFrame, column: str, values: Sequence[Any], kind: pa.DataType, *, keep: bool
) -> DataFrame:
    """``frame``'s rows whose ``column`` is one of ``values`` (``keep``), or the other rows.

    Up to `ISIN_LIMIT` values go into an ``IN (...)`` filter; more travel as an
    Arrow table and are broadcast to a semi- or anti-join.
    """
    if not values:
        return frame.where(F.lit(False)) if keep else frame
    if len(values) <= ISIN_LIMIT:
        matches = F.col(column).isin(list(values))
        return frame.where(matches if keep else ~matches)
    table = pa.table({column: pa.array(values, kind)})
    listed = frame.sparkSession.createDataFrame(table)
    return frame.join(F.broadcast(listed), column, "left_semi" if keep else "left_anti")


def output_schema(data: StructType) -> StructType:
    """The pipeline's output: the data columns (all nullable: poison rows hold none) and markers."""
    clash = [name for name in data.fieldNames() if name in MARKERS]
    if clash:
        raise ConfigurationError(f"columns {clash} are reserved for reliable's own markers")
    fields = [StructField(f.name, f.dataType, True) for f in data.fields]
    fields += [
        StructField(name, LongType() if name == ROW_ID else StringType(), True) for name in MARKERS
    ]
    return StructType(fields)


def parse_schema(schema: StructType | str | None) -> StructType | None:
    """A validated-row schema given as a `StructType` or a DDL string."""
    if schema is None or isinstance(schema, StructType):
        return schema
    try:
        parsed = StructType.fromDDL(schema)
    except Exception as exc:
        raise ConfigurationError(f"schema={schema!r} is not a valid DDL schema: {exc}") from exc
    if not isinstance(parsed, StructType):
        raise ConfigurationError(f"schema={schema!r} is not a struct of columns")
    return parsed
