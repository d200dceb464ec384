"""One local SparkSession for the whole run, and helpers to stream JSON files through it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER_SCHEMA = "order_id string, amount long, note string"


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """local[2], two shuffle partitions, no UI: one per test run (it takes seconds to start)."""
    pyspark_sql = pytest.importorskip("pyspark.sql")
    # Spark's Python workers import the test modules' functions (validate steps) by name.
    paths = [str(ROOT), str(ROOT / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers run in this venv
    session = (
        pyspark_sql.SparkSession.builder.master("local[2]")
        .appName("reliable-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def write_orders(folder: Path, name: str, orders: Sequence[dict[str, Any]]) -> None:
    """One JSON-lines file of orders: one micro-batch with ``maxFilesPerTrigger=1``."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{name}.tmp"
    partial.write_text("".join(json.dumps(order) + "\n" for order in orders))
    partial.rename(folder / f"{name}.json")  # the file source must never see half a file


def run_stream(
    spark: Any, source: Path, checkpoint: Path, batch_function: Callable[[Any, int], Any]
) -> None:
    """Stream every file in ``source`` (one per batch) through ``batch_function``, until done."""
    stream = spark.readStream.schema(ORDER_SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))
    query = (
        stream.writeStream.foreachBatch(batch_function)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def order(order_id: str | None, amount: int = 10, note: str = "") -> dict[str, Any]:
    return {"order_id": order_id, "amount": amount, "note": note}
