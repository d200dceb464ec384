"""The pipeline's Spark job: the broker as a streaming source, each order into PostgreSQL once.

    python -m examples.pipeline.job reliable://127.0.0.1:7600 orders CHECKPOINT DATABASE_URL

It reads everything there is (``trigger(availableNow=True)``, at most
``--max-rows`` rows per micro-batch), parses the JSON bodies, and hands each
batch to ``@foreach_batch``: rows whose token is already recorded are dropped,
rows whose amount is not a number go to ``pipeline_dlq``, the rest are
inserted into ``pipeline_orders`` in the same PostgreSQL transaction as their
tokens and the batch fence. Killed at any point and started again from its
checkpoint, it writes nothing twice.
"""

from __future__ import annotations

import argparse
from typing import Any

from pyspark.sql import functions as F
from sqlalchemy import text

import reliable
from reliable.spark import foreach_batch, insert_rows
from reliable.spark.session import local_session
from reliable.spark.source import ReliableSource

ORDER = "token string, customer string, amount string"
TABLE, DEAD_LETTERS = "pipeline_orders", "pipeline_dlq"


def parse_order(row: dict[str, Any]) -> dict[str, Any]:
    """Validate step (on the executors): the amount must be a number; it becomes cents."""
    return {"token": row["token"], "customer": row["customer"], "amount_cents": round(float(row["amount"]) * 100)}


def build_app(database_url: str, table: str) -> reliable.App:
    env = {"RELIABLE_STORE__URL": database_url, "RELIABLE_CACHE__URL": "memory://",
           "RELIABLE_TRANSPORT__URL": "memory://", "RELIABLE_LOG__LEVEL": "warning"}
    app = reliable.App(reliable.Settings.load(None, env=env))
    with app.store.transaction() as tx:
        tx.execute(text(f"create table if not exists {table} "
                        "(token text, customer text, amount_cents bigint)"))
    return app


def run(url: str, topic: str, checkpoint: str, database_url: str, max_rows: int,
        table: str = TABLE) -> None:
    app = build_app(database_url, table)

    @foreach_batch(app, name=f"pipeline-{topic}", token="token", validate=parse_order,
                   schema="token string, customer string, amount_cents long",
                   dead_letters=f"{table}_dlq" if table != TABLE else DEAD_LETTERS)
    def write(df, batch_id, tx):  # type: ignore[no-untyped-def]
        insert_rows(df, tx, table)

    def batch(df, batch_id):  # type: ignore[no-untyped-def]
        orders = df.select(F.from_json("json", ORDER).alias("o")).select("o.*")
        report = write(orders, batch_id)
        print(f"batch {batch_id}: {report.status.value}, written {report.written}, "
              f"duplicates {report.duplicates}, poison {report.poison}", flush=True)

    spark = local_session("reliable-pipeline")
    spark.dataSource.register(ReliableSource)
    stream = (spark.readStream.format("reliable").option("url", url).option("topic", topic)
              .option("group", f"spark-{topic}").option("maxRowsPerBatch", max_rows).load())
    query = (stream.writeStream.foreachBatch(batch).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()
    write.flush()
    app.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("topic")
    parser.add_argument("checkpoint")
    parser.add_argument("database_url")
    parser.add_argument("--max-rows", type=int, default=20_000)
    parser.add_argument("--table", default=TABLE, help=f"the orders table (dead letters: TABLE_dlq; default {TABLE})")
    args = parser.parse_args()
    run(args.url, args.topic, args.checkpoint, args.database_url, args.max_rows, args.table)
