"""Rows per second through the broker's Spark source, next to Spark's file source and the broker's own read.

One run, local[2], the same N JSON messages (about 60 bytes each), every stream
read with availableNow and written by foreachBatch to Spark's ``noop`` sink (every
column of every row made, nothing kept; the rows counted from the query's progress),
after one warm-up run of each over 1% of the rows (Spark's Python workers started, the
JVM's code compiled, as a long-running query has them). Two rates: the whole query (its
start and stop included: for the broker source, Spark starts a fresh Python process on
the driver for the source's offsets at every query start) and its batches alone (the
progress's triggerExecution: what a long-running query sees):

  broker source, body     spark.readStream.format("reliable") over embedded://, all columns
                          (the body as bytes, the json column as text)
  file source, text       spark.readStream.text() over the same rows in JSON-lines files
                          (one file per queue): each line as it is
  broker source, parsed   the broker source's json column parsed by Spark's from_json into
                          the rows' three fields
  file source, json       spark.readStream.json() over the files: the same three fields
  broker read             the engine's read by position, 1,000 at a time, column by column
                          (what the source's executors ask for, without Spark)

    python -m benchmarks.spark_source [--messages N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.delivery.values import OutgoingMessage
from broker.embedded import open_embedded
from reliable.spark.session import local_session
from reliable.spark.source import ReliableSource

ROW_SCHEMA = "token string, customer string, amount string"


def timed_stream(stream: Any, checkpoint: Path) -> tuple[float, float, int]:
    """Seconds (the whole query; its batches alone) and rows of one availableNow run of
    ``stream`` into the noop sink."""

    def write(df, batch_id):  # type: ignore[no-untyped-def]
        df.write.format("noop").mode("overwrite").save()

    began = time.perf_counter()
    query = (stream.writeStream.foreachBatch(write).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    seconds = time.perf_counter() - began
    progress = query.recentProgress
    batches = sum(int(p["durationMs"].get("triggerExecution", 0)) for p in progress if int(p["numInputRows"])) / 1000
    return seconds, batches, sum(int(p["numInputRows"]) for p in progress)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    count = parser.parse_args().messages
    with tempfile.TemporaryDirectory() as folder, open_embedded(Path(folder) / "broker") as broker:
        root = Path(folder)  # the broker closes before its folder goes, also when a query fails
        warm = max(1, count // 100)
        for topic, size in (("orders", count), ("warm-up", warm)):
            rows = [{"token": f"o-{n}", "customer": f"c-{n % 97}", "amount": f"{n % 1000}.50"} for n in range(size)]
            for start in range(0, size, 5000):
                broker.publish(topic, [OutgoingMessage(json.dumps(r).encode(), headers={"content-type": "application/json"})
                                       for r in rows[start:start + 5000]])
            (root / topic).mkdir()
            for queue in range(4):
                (root / topic / f"{queue}.json").write_text("".join(json.dumps(r) + "\n" for r in rows[queue::4]))

        began = time.perf_counter()
        for queue, (first, end) in enumerate(broker.queue_offsets("orders")):
            offset = first
            while offset < end:
                offset = broker.read_columns("orders", queue, offset, 1000).column("offset")[-1] + 1
        read_rate = count / (time.perf_counter() - began)

        from pyspark.sql import functions as F

        spark = local_session("spark-source-benchmark")
        spark.dataSource.register(ReliableSource)

        def streams(topic: str) -> dict[str, Any]:
            source = spark.readStream.format("reliable").option("url", f"embedded://{root / 'broker'}").option(
                "topic", topic).load()
            return {
                "broker source, body": source,
                "file source, text": spark.readStream.text(str(root / topic)),
                "broker source, parsed (from_json)": source.select(
                    F.from_json("json", ROW_SCHEMA).alias("row")).select("row.*"),
                "file source, json": spark.readStream.schema(ROW_SCHEMA).json(str(root / topic)),
            }

        rates, batch_rates = {}, {}
        for topic, size in (("warm-up", warm), ("orders", count)):
            for number, (name, stream) in enumerate(streams(topic).items()):
                seconds, batches, seen = timed_stream(stream, root / f"checkpoint-{topic}-{number}")
                assert seen == size, (name, seen, size)
                rates[name], batch_rates[name] = size / seconds, size / max(batches, 1e-3)
        spark.stop()
    print(f"{count} rows, local[2], one run\n")
    print(f"{'':<36}{'query rows/s':>14}{'vs file':>9}{'batch rows/s':>14}{'vs file':>9}")
    for name, peer in (("broker source, body", "file source, text"),
                       ("broker source, parsed (from_json)", "file source, json")):
        print(f"{name:<36}{rates[name]:>14,.0f}{rates[name] / rates[peer]:>8.2f}x"
              f"{batch_rates[name]:>14,.0f}{batch_rates[name] / batch_rates[peer]:>8.2f}x")
        print(f"{peer:<36}{rates[peer]:>14,.0f}{'':>9}{batch_rates[peer]:>14,.0f}")
    print(f"{'broker read by position, no Spark':<36}{read_rate:>12,.0f}")


if __name__ == "__main__":
    main()
