"""The driver's view of one micro-batch after the executors prepared it.

`prepare` marks every row on the executors with its token (with a
``validate`` step, through the `RowPipeline` in ``mapInArrow``, no shuffle)
and collects only what the driver needs for the batch transaction: the
distinct tokens of the good rows and the poison rows. `PreparedBatch.rows`
hands the user's function the good rows whose tokens the transaction
actually claimed, one row per token; the rows themselves never leave the
executors.

The batch is read twice: once for its tokens, once by the user's function.
It is cached in between unless reading it again is known to give the same
rows (see `rereadable`), so the tokens claimed and the rows handed over are
the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from py4j.protocol import Py4JError
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StringType, StructField, StructType

from backends.errors import ConfigurationError
from backends.store.schema import TOKEN_MAX
from reliable.spark.deadletters import PoisonRow, row_json
from reliable.spark.rows import (
    ERROR,
    ERROR_TYPE,
    MARKERS,
    ROW_JSON,
    TOKEN,
    RowPipeline,
    Validate,
    token_problem,
)

GOOD = "_reliable_good"  # a column of the collected markers only
ISIN_LIMIT = 1_000  # values filtered with IN (...); more go through a broadcast anti-join

BatchFunction = Callable[[DataFrame, int, Any], Any]
"""The user's function: the batch's new, valid rows, the batch id and the store transaction."""


@dataclass
class PreparedBatch:
    """A batch marked (and validated) on the executors, with its tokens and poison on the driver."""

    frame: DataFrame  # the rows and their markers; cached until `release` when ``cached``
    cached: bool
    good: Column | None  # the filter of the rows that are not poison; None: the batch has none
    tokens: list[str]  # the distinct tokens of the good rows
    poison: list[PoisonRow] = field(default_factory=list)
    copies: bool = False  # some token is held by more than one good row

    def rows(self, claimed: set[str] | None = None) -> DataFrame:
        """The good rows, one per token, without the markers; only those of ``claimed`` if given.

        A token the claim did not get was already recorded (by an earlier
        batch, or a concurrent writer): its row is dropped.
        """
        return self._good(claimed).drop(*MARKERS)

    def collect_rows(self) -> list[tuple[str, dict[str, Any]]]:
        """Every good row with its token, on the driver (only for dead-lettering a whole batch)."""
        table = self._good(None).drop(ERROR_TYPE, ERROR, ROW_JSON).toArrow()
        tokens = table.column(TOKEN).to_pylist()
        return list(zip(tokens, table.drop_columns([TOKEN]).to_pylist(), strict=True))

    def release(self) -> None:
        """Drop the cached rows."""
        if self.cached:
            self.frame.unpersist()

    def _good(self, claimed: set[str] | None) -> DataFrame:
        good = self.frame if self.good is None else self.frame.where(self.good)
        if claimed is not None and len(claimed) < len(self.tokens):
            known = [t for t in self.tokens if t not in claimed]
            if len(claimed) < len(known):  # fewer rows to keep than to drop: select those
                good = _matching(good, TOKEN, sorted(claimed), keep=True)
            else:
                good = _matching(good, TOKEN, known, keep=False)
        return good.dropDuplicates([TOKEN]) if self.copies else good


def prepare(
    df: DataFrame,
    *,
    token: str,
    validate: Validate | None = None,
    schema: StructType | None = None,
    cache: bool = False,
) -> PreparedBatch:
    """Mark (and validate) the rows on the executors; collect the tokens and the poison rows.

    Every row gets its token (the column cast to a string) on the JVM side.
    Without ``validate`` the rows never leave the JVM and the only poison is a
    row without a token; with it they go through `RowPipeline`
    (``mapInArrow``), which adds the error markers. The marked rows are cached
    when ``cache`` is set, when there is a ``validate`` step (it runs once) or
    when the batch is not `rereadable`.
    """
    data = df.schema
    if token not in data.fieldNames():
        raise ConfigurationError(
            f"token={token!r} is not a column of the batch; columns: {', '.join(data.fieldNames())}"
        )
    output_schema(data)  # refuses data columns named like the markers
    frame = df.select("*", df[token].cast("string").alias(TOKEN))
    if validate is None:
        good = _recordable(F.col(TOKEN))
    else:
        output = output_schema(schema if schema is not None else data)
        timezone = df.sparkSession.conf.get("spark.sql.session.timeZone")
        pipeline = RowPipeline(token, to_arrow_schema(output, timezone=timezone), validate)
        frame, good = frame.mapInArrow(pipeline, output), F.col(ERROR_TYPE).isNull()
    cached = cache or validate is not None or not rereadable(df)
    if cached:
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        if validate is None:
            markers = frame.select(TOKEN, good.alias(GOOD)).toArrow()
            is_good = markers.column(GOOD)
            poison = [] if pc.all(is_good).as_py() else _tokenless(frame.where(~good), token)
        else:
            markers = frame.select(TOKEN, ERROR_TYPE, ERROR, ROW_JSON).toArrow()
            is_good = pc.is_null(markers.column(ERROR_TYPE))
            poison = markers.filter(pc.invert(is_good)).to_pylist()
        good_tokens = markers.column(TOKEN).filter(is_good)
        distinct = pc.unique(good_tokens)
        # sorted here, in Arrow: the claim sorts them again (its lock order), in one pass
        tokens = distinct.take(pc.array_sort_indices(distinct)).to_pylist()
    except BaseException:
        if cached:
            frame.unpersist()
        raise
    copies = len(tokens) < len(good_tokens)
    if not poison:  # the common case: no filter, nothing to dead-letter
        return PreparedBatch(frame, cached, None, tokens, [], copies)
    return PreparedBatch(frame, cached, good, tokens, _one_per_token(poison, set(tokens)), copies)


def rereadable(df: DataFrame) -> bool:
    """Whether reading ``df`` again gives the same rows in the same order.

    Spark tracks this for its own task retries as the output deterministic
    level of the batch's RDD: ``DETERMINATE`` when every step from the source
    is row by row (a streaming source gives a micro-batch the same rows on
    every read, as Spark's replays already require). A shuffle, a stateful
    operator or an order-sensitive step after them makes it ``UNORDERED`` or
    ``INDETERMINATE``. A Python UDF that returns something else on every call
    is not tracked: pass ``cache=True`` for such a batch.
    """
    try:
        level = df._jdf.queryExecution().toRdd().outputDeterministicLevel().toString()
    except (AttributeError, Py4JError):  # not a classic JVM DataFrame: cache, the safe side
        return False
    return str(level) == "DETERMINATE"


def _recordable(token: Column) -> Column:
    """Whether the row's token is one the store can record (`rows.token_problem`), in Spark."""
    return token.isNotNull() & (F.length(token) <= TOKEN_MAX) & (F.instr(token, "\x00") == 0)


def _tokenless(poison: DataFrame, token: str) -> list[dict[str, Any]]:
    """``poison``'s rows (no token the store can record) as poison markers, each with its error
    and the row as JSON, without the token (collected: only those rows)."""
    rows = poison.toArrow().to_pylist()
    return [{TOKEN: None, ERROR_TYPE: type(error).__name__, ERROR: str(error),
             ROW_JSON: row_json({k: v for k, v in row.items() if k != TOKEN})}
            for row in rows if (error := token_problem(row[TOKEN], token))]  # fmt: skip


def _one_per_token(rows: list[dict[str, Any]], good: set[str]) -> list[PoisonRow]:
    """Poison rows, typed: one per token, none for a token another task passed."""
    kept: list[PoisonRow] = []
    for row in rows:
        token = row[TOKEN]
        if token is not None:
            if token in good:
                continue
            good.add(token)
        kept.append(PoisonRow(token, row[ROW_JSON], row[ERROR_TYPE], row[ERROR]))
    return kept


def _matching(frame: DataFrame, column: str, values: Sequence[str], *, keep: bool) -> DataFrame:
    """``frame``'s rows whose ``column`` is one of ``values`` (``keep``), or the other rows.

    Up to `ISIN_LIMIT` values go into an ``IN (...)`` filter; more travel as an
    Arrow table and are broadcast to a semi- or anti-join.
    """
    if not values:
        return frame.where(F.lit(False)) if keep else frame
    if len(values) <= ISIN_LIMIT:
        matches = F.col(column).isin(list(values))
        return frame.where(matches if keep else ~matches)
    table = pa.table({column: pa.array(values, pa.string())})
    listed = frame.sparkSession.createDataFrame(table)
    return frame.join(F.broadcast(listed), column, "left_semi" if keep else "left_anti")


def output_schema(data: StructType) -> StructType:
    """The pipeline's output: the data columns (all nullable: poison rows hold none) and markers."""
    clash = [name for name in data.fieldNames() if name in MARKERS]
    if clash:
        raise ConfigurationError(f"columns {clash} are reserved for reliable's own markers")
    fields = [StructField(f.name, f.dataType, True) for f in data.fields]
    fields += [StructField(name, StringType(), True) for name in MARKERS]
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
