"""Spark orders: each order written exactly once, through duplicates, bad rows and a driver crash.

    .venv/bin/python -m examples.spark_orders

A file source streams order files (one per micro-batch) that contain
duplicates (inside a file and across files), rows with a bad amount and
rows without an ``order_id``. ``@foreach_batch`` drops the duplicates on the
executors, sends the bad rows to the ``orders_dlq`` table and writes the rest
into ``orders`` in the same SQLite transaction as the tokens and the batch
fence. The first run is a child process whose driver dies (``os._exit``)
right after batch 2 committed, before Spark could record it; the second run
restarts from the same checkpoint, Spark replays batch 2, the fence skips it,
and the final count shows every valid order exactly once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from sqlalchemy import text

import reliable
from reliable.spark import BatchStatus, foreach_batch, insert_rows, read_dead_letters
from reliable.spark.session import local_session

HOME = Path(".reliable/spark-example")
SOURCE, CHECKPOINT = HOME / "in", HOME / "checkpoint"
FILES, ORDERS_PER_FILE, CRASH_AFTER_BATCH = 6, 400, 2
ORDER_SCHEMA = "order_id string, customer string, amount string"
CRASH_EXIT_CODE = 3


def parse_order(row: dict[str, Any]) -> dict[str, Any]:
    """The per-row validate step: the amount must be a positive decimal; it becomes cents."""
    cents = round(float(row["amount"]) * 100)
    if cents <= 0:
        raise ValueError(f"amount must be positive, got {row['amount']!r}")
    return {"order_id": row["order_id"], "customer": row["customer"], "amount_cents": cents}


def build_app() -> reliable.App:
    """The app: a SQLite store under .reliable/spark-example, no broker needed."""
    env = {
        "RELIABLE_STORE__URL": f"sqlite:///{HOME.resolve() / 'store.db'}",
        "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_TRANSPORT__URL": "memory://",
        "RELIABLE_LOG__LEVEL": "warning",
    }
    return reliable.App(reliable.Settings.load(None, env=env))


def make_orders() -> set[str]:
    """Write the order files; return the order ids a correct pipeline writes (each once)."""
    rng = random.Random(7)
    valid: list[str] = []
    SOURCE.mkdir(parents=True)
    for number in range(FILES):
        rows: list[dict[str, Any]] = []
        for i in range(ORDERS_PER_FILE):
            roll = rng.random()
            if roll < 0.15 and valid:  # a duplicate of an order already sent (this file or earlier)
                rows.append({"order_id": rng.choice(valid), "customer": "again", "amount": "1.00"})
            elif roll < 0.19:
                rows.append({"order_id": f"bad-{number}-{i}", "customer": "c", "amount": "-5"})
            elif roll < 0.21:
                rows.append({"order_id": None, "customer": "c", "amount": "3.50"})
            else:
                order_id = f"o-{number}-{i}"
                valid.append(order_id)
                rows.append({"order_id": order_id, "customer": f"c{i % 17}", "amount": "12.30"})
        path = SOURCE / f"{number}.json"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        stamp = (
            time.time() - 3600 + number
        )  # the file source reads files in modification-time order
        os.utime(path, (stamp, stamp))
    return set(valid)


def spark_session() -> Any:
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    return local_session("reliable-spark-orders")


def run_query(crash_after: int | None) -> None:
    """Stream every order file through the reliable batch function (dies after a batch if told)."""
    spark, app = spark_session(), build_app()

    @foreach_batch(
        app,
        name="orders-sink",
        token="order_id",
        retry=reliable.RedeliveryPolicy(initial_delay=0.2, multiplier=2.0, max_redeliveries=3),
        dead_letters="orders_dlq",
        validate=parse_order,
        schema="order_id string, customer string, amount_cents long",
        sink="store",  # every effect goes through tx (on PostgreSQL the claim goes ahead of it)
    )
    def write(df: Any, batch_id: int, tx: Any) -> None:
        insert_rows(df, tx, "orders")  # same transaction as the tokens and the fence

    def batch_function(df: Any, batch_id: int) -> None:
        report = write(df, batch_id)
        print(
            f"  batch {batch_id}: {report.status.value:<9} written={report.written:<4} "
            f"poison={report.poison}",
            flush=True,
        )
        if (
            crash_after is not None
            and batch_id == crash_after
            and report.status is BatchStatus.COMMITTED
        ):
            print(
                f"  ** driver killed after batch {batch_id} committed, before Spark recorded it **",
                flush=True,
            )
            os._exit(CRASH_EXIT_CODE)

    stream = spark.readStream.schema(ORDER_SCHEMA).option("maxFilesPerTrigger", 1).json(str(SOURCE))
    query = (
        stream.writeStream.foreachBatch(batch_function)
        .option("checkpointLocation", str(CHECKPOINT))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def summary(app: reliable.App, expected: set[str]) -> bool:
    with app.store.transaction() as tx:
        rows = tx.execute(text("SELECT order_id, count(*) FROM orders GROUP BY order_id")).all()
    counts = dict(rows)
    letters = read_dead_letters(app.store, "orders_dlq", name="orders-sink")
    by_error: dict[str, int] = {}
    for letter in letters:
        by_error[letter.error_type] = by_error.get(letter.error_type, 0) + 1
    ok = set(counts) == expected and set(counts.values()) == {1}
    print(
        f"\norders written: {sum(counts.values())} rows, {len(counts)} distinct order ids "
        f"(expected {len(expected)}), most copies of one order: {max(counts.values())}"
    )
    print(f"dead letters: {len(letters)} {by_error}")
    print("each valid order written exactly once: " + ("YES" if ok else "NO"))
    return ok


def main() -> int:
    if "--crash-after" in sys.argv:
        run_query(int(sys.argv[sys.argv.index("--crash-after") + 1]))
        return 0
    started = time.monotonic()
    shutil.rmtree(HOME, ignore_errors=True)
    expected = make_orders()
    app = build_app()
    with app.store.transaction() as tx:
        tx.execute(text("CREATE TABLE orders (order_id TEXT, customer TEXT, amount_cents INTEGER)"))
    print(f"{FILES} files x {ORDERS_PER_FILE} orders, with duplicates and bad rows\n\nfirst run:")
    with open(HOME / "first-run.log", "w") as errors:  # Spark's own noise when its driver dies
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "examples.spark_orders",
                "--crash-after",
                str(CRASH_AFTER_BATCH),
            ],
            stderr=errors,
            check=False,
        )
    if child.returncode != CRASH_EXIT_CODE:
        print(
            f"the first run should have crashed; it exited with {child.returncode}, see {errors.name}"
        )
        return 1
    print("\nrestart from the same checkpoint:")
    run_query(crash_after=None)
    ok = summary(app, expected)
    print(f"({time.monotonic() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
