"""Rows per second through the broker's Spark source, next to Spark's file source and the broker's own read.

One run, local[2], the same N JSON messages (about 60 bytes each):

  broker source   spark.readStream.format("reliable") over embedded://, availableNow,
                  foreachBatch counting the rows
  file source     spark.readStream.json() over the same rows in JSON-lines files (the
                  messages of one queue per file), availableNow, foreachBatch counting
  broker read     the engine's read by position, 1,000 at a time (what the source's
                  executors do, without Spark)

    python -m benchmarks.spark_source [--messages N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from broker.delivery.values import OutgoingMessage
from broker.embedded import open_embedded
from reliable.spark.session import local_session
from reliable.spark.source import ReliableSource


def timed_stream(spark, stream, checkpoint: Path) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    seen = [0]

    def count(df, batch_id):  # type: ignore[no-untyped-def]
        seen[0] += df.count()

    began = time.perf_counter()
    query = (stream.writeStream.foreachBatch(count).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    return time.perf_counter() - began, seen[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    count = parser.parse_args().messages
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        broker = open_embedded(root / "broker")
        rows = [{"token": f"o-{n}", "customer": f"c-{n % 97}", "amount": f"{n % 1000}.50"} for n in range(count)]
        for start in range(0, count, 5000):
            broker.publish("orders", [OutgoingMessage(json.dumps(r).encode(), headers={"content-type": "application/json"})
                                      for r in rows[start:start + 5000]])
        (root / "files").mkdir()
        for queue in range(4):
            (root / "files" / f"{queue}.json").write_text("".join(json.dumps(r) + "\n" for r in rows[queue::4]))

        began = time.perf_counter()
        for queue, (first, end) in enumerate(broker.queue_offsets("orders")):
            offset = first
            while offset < end:
                offset = broker.read("orders", queue, offset, 1000)[-1].offset + 1
        read_rate = count / (time.perf_counter() - began)

        spark = local_session("spark-source-benchmark")
        spark.dataSource.register(ReliableSource)
        source = spark.readStream.format("reliable").option("url", f"embedded://{root / 'broker'}").option(
            "topic", "orders").load()
        source_seconds, source_rows = timed_stream(spark, source, root / "checkpoint-source")
        files = spark.readStream.schema("token string, customer string, amount string").json(str(root / "files"))
        file_seconds, file_rows = timed_stream(spark, files, root / "checkpoint-files")
        spark.stop()
        broker.close()
    assert source_rows == file_rows == count, (source_rows, file_rows)
    print(f"{count} rows, local[2], one run\n")
    print(f"{'broker source (format reliable)':<34}{count / source_seconds:>12,.0f} rows/s")
    print(f"{'file source (json)':<34}{count / file_seconds:>12,.0f} rows/s")
    print(f"{'broker read by position, no Spark':<34}{read_rate:>12,.0f} rows/s")


if __name__ == "__main__":
    main()
