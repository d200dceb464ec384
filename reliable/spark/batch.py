"""The driver's view of one micro-batch after the executors prepared it.

`prepare` repartitions the batch by token, runs the `RowPipeline` on the
executors through ``mapInArrow`` and caches the result, then collects only
what the driver needs for the batch transaction: the surviving tokens (to
claim) and the poison rows (to dead-letter). The rows themselves stay on the
executors; `PreparedBatch.rows` hands the user's function the good rows whose
tokens the transaction actually claimed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StringType, StructField, StructType

from backends.errors import ConfigurationError
from reliable.spark.rows import ERROR, ERROR_TYPE, MARKERS, ROW_JSON, TOKEN, RowPipeline, Validate
from reliable.spark.tokens import KnownTokens

ISIN_LIMIT = 1_000  # lost tokens filtered with IN (...); more go through an anti-join


@dataclass
class PreparedBatch:
    """A batch de-duplicated and validated on the executors, cached until `release`."""

    frame: DataFrame
    tokens: list[str]
    poison: list[dict[str, Any]] = field(default_factory=list)

    def rows(self, claimed: set[str] | None = None) -> DataFrame:
        """The good rows, without the markers; only those whose token is in ``claimed`` if given.

        A token the executors saw as new but the claim did not get was
        recorded meanwhile by a concurrent writer: its row is dropped.
        """
        good = self.frame.where(F.col(ERROR_TYPE).isNull())
        lost = [] if claimed is None else [t for t in self.tokens if t not in claimed]
        if len(lost) > ISIN_LIMIT:
            spark = self.frame.sparkSession
            lost_frame = spark.createDataFrame([(t,) for t in lost], f"{TOKEN} string")
            good = good.join(F.broadcast(lost_frame), TOKEN, "left_anti")
        elif lost:
            good = good.where(~F.col(TOKEN).isin(lost))
        return good.drop(*MARKERS)

    def collect_rows(self) -> list[tuple[str, dict[str, Any]]]:
        """Every good row with its token, on the driver (only for dead-lettering a whole batch)."""
        good = self.frame.where(F.col(ERROR_TYPE).isNull()).drop(ERROR_TYPE, ERROR, ROW_JSON)
        table = good.toArrow()
        tokens = table.column(TOKEN).to_pylist()
        return list(zip(tokens, table.drop_columns([TOKEN]).to_pylist(), strict=True))

    def release(self) -> None:
        """Drop the cached rows."""
        self.frame.unpersist()


def prepare(
    df: DataFrame,
    *,
    token: str,
    known: KnownTokens,
    validate: Validate | None = None,
    schema: StructType | None = None,
) -> PreparedBatch:
    """Run the row pipeline on the executors and collect tokens and poison rows."""
    if token not in df.columns:
        raise ConfigurationError(
            f"token={token!r} is not a column of the batch; columns: {', '.join(df.columns)}"
        )
    output = output_schema(schema if schema is not None else df.schema)
    timezone = df.sparkSession.conf.get("spark.sql.session.timeZone")
    pipeline = RowPipeline(token, known, to_arrow_schema(output, timezone=timezone), validate)
    frame = df.repartition(F.col(token)).mapInArrow(pipeline, output)
    frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        markers = frame.select(TOKEN, ERROR_TYPE, ERROR, ROW_JSON).toArrow()
    except BaseException:
        frame.unpersist()
        raise
    good = pc.is_null(markers.column(ERROR_TYPE))
    tokens = markers.filter(good).column(TOKEN).to_pylist()
    poison = [
        {
            "token": row[TOKEN],
            "row_json": row[ROW_JSON],
            "error_type": row[ERROR_TYPE],
            "error_message": row[ERROR],
        }
        for row in markers.filter(pc.invert(good)).to_pylist()
    ]
    return PreparedBatch(frame, tokens, poison)


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
    if isinstance(schema, str):
        try:
            parsed = StructType.fromDDL(schema)
        except Exception as exc:
            raise ConfigurationError(f"schema={schema!r} is not a valid DDL schema: {exc}") from exc
        if not isinstance(parsed, StructType):
            raise ConfigurationError(f"schema={schema!r} is not a struct of columns")
        return parsed
    raise ConfigurationError(
        f"schema={schema!r} is not allowed; expected a StructType or DDL string"
    )


BatchFunction = Callable[[DataFrame, int, Any], Any]
"""The user's function: the batch's new, valid rows, the batch id and the store transaction."""
