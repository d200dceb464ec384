"""Helpers for the Spark tests: order files (one per micro-batch) and a query run to the end."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ORDER_SCHEMA = "order_id string, amount long, note string"


def write_orders(folder: Path, name: str, orders: Sequence[dict[str, Any]]) -> None:
    """File ``<name>.json`` (``name`` a number) of orders: one micro-batch with ``maxFilesPerTrigger=1``."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{name}.tmp"
    partial.write_text("".join(json.dumps(order) + "\n" for order in orders))
    # the file source takes files in modification-time order: make it the order of the names
    stamp = time.time() - 3600 + int(name)
    os.utime(partial, (stamp, stamp))
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
