"""Rows per second through the broker's Spark source, next to Spark's file source and the broker's own read.

local[2], the same N JSON messages (about 60 bytes each), every stream read with
availableNow and written by foreachBatch to Spark's ``noop`` sink (every column of
every row made, nothing kept; the rows counted from the query's progress). The
streams take turns, round after round over all the rows: the first round, untimed,
starts Spark's Python workers and has the JVM compile each stream's code, as a
long-running query has them (a warm-up over 1% of the rows left the broker source's
per-row code to be compiled inside the timed batch: 2-3 times its steady time); each
stream's figure is its median over the ``--runs`` timed rounds (a shared machine's
load moves single runs by 2x). Two rates: the whole query (its start and stop
included: for the broker source, Spark starts a fresh Python process on the driver
for the source's offsets at every query start) and its batches alone (the progress's
triggerExecution: what a long-running query sees):

  broker source, body     spark.readStream.format("reliable") over embedded://, all columns
                          (the body as bytes, the json column as text): a partition per queue
                          (4), so two waves of tasks on the two cores
  ... maxPartitions=2     the same with option("maxPartitions", 2): one task per core, each
                          reading two queues (the file source too makes two partitions here)
  file source, text       spark.readStream.text() over the same rows in JSON-lines files
                          (one file per queue): each line as it is
  broker source, parsed   the broker source's json column parsed by Spark's from_json into
                          the rows' three fields
  file source, json       spark.readStream.json() over the files: the same three fields
  python source floor     a Python data source of the broker source's schema in two
                          partitions (10,000 rows per Arrow batch) that hands Spark one Arrow
                          batch it made once, again and again: what Spark's way from a Python
                          reader to the JVM costs any such source, whatever it reads (body,
                          and parsed with from_json)
  broker read             the engine's read by position, 1,000 at a time, column by column
                          (what the source's executors ask for, without Spark)

    python -m benchmarks.spark_source [--messages N] [--runs R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from broker.delivery.values import OutgoingMessage
from broker.embedded import open_embedded
from reliable.spark.session import local_session
from reliable.spark.source import QueueRange, ReliableSource

ROW_SCHEMA = "token string, customer string, amount string"
FLOOR_BATCH = 10_000  # rows per Arrow batch, as the broker source's reads of small messages


class FloorSource(DataSource):  # type: ignore[misc]
    """``format("python-floor")``: ``rows`` rows in ``queues`` partitions, one Arrow batch of
    the broker source's schema made per partition and handed to Spark again and again."""

    @classmethod
    def name(cls) -> str:
        return "python-floor"

    def schema(self) -> str:
        from reliable.spark.arrow import SCHEMA

        return SCHEMA

    def streamReader(self, schema: Any) -> FloorReader:
        return FloorReader(int(self.options["rows"]), int(self.options["queues"]))


class FloorReader(DataSourceStreamReader):  # type: ignore[misc]
    def __init__(self, rows: int, queues: int) -> None:
        self.rows, self.queues = rows, queues

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        return {"rows": 0}

    def latestOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        return {"rows": self.rows}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        rows = end["rows"] - start["rows"]
        return [QueueRange("", "floor", q, q * rows // self.queues, (q + 1) * rows // self.queues)
                for q in range(self.queues) if rows]

    def read(self, partition: InputPartition) -> Any:
        from reliable.spark.arrow import record_batch

        assert isinstance(partition, QueueRange)
        bodies = [json.dumps({"token": f"o-{n}", "customer": f"c-{n % 97}", "amount": f"{n % 1000}.50"}).encode()
                  for n in range(FLOOR_BATCH)]
        batch = record_batch(FLOOR_BATCH, {
            "topic": "floor", "queue": partition.queue, "key": "", "tag": "", "delivery_count": 1,
            "headers": {"content-type": "application/json"}}, {
            "offset": list(range(FLOOR_BATCH)), "message_id": [f"{n:032x}" for n in range(FLOOR_BATCH)],
            "body": bodies, "published_at": [time.time()] * FLOOR_BATCH})
        for start in range(partition.start, partition.end, FLOOR_BATCH):
            yield batch.slice(0, min(FLOOR_BATCH, partition.end - start))

    def commit(self, end: dict[str, int]) -> None:
        pass


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
    parser.add_argument("--runs", type=int, default=3, help="timed rounds (after one untimed)")
    arguments = parser.parse_args()
    count, runs = arguments.messages, arguments.runs
    with tempfile.TemporaryDirectory() as folder, open_embedded(Path(folder) / "broker") as broker:
        root = Path(folder)  # the broker closes before its folder goes, also when a query fails
        rows = [{"token": f"o-{n}", "customer": f"c-{n % 97}", "amount": f"{n % 1000}.50"} for n in range(count)]
        for start in range(0, count, 5000):
            broker.publish("orders", [OutgoingMessage(json.dumps(r).encode(), headers={"content-type": "application/json"})
                                      for r in rows[start:start + 5000]])
        (root / "orders").mkdir()
        for queue in range(4):
            (root / "orders" / f"{queue}.json").write_text("".join(json.dumps(r) + "\n" for r in rows[queue::4]))

        began = time.perf_counter()
        for queue, (first, end) in enumerate(broker.queue_offsets("orders")):
            offset = first
            while offset < end:
                offset = broker.read_columns("orders", queue, offset, 1000).column("offset")[-1] + 1
        read_rate = count / (time.perf_counter() - began)

        from pyspark.sql import functions as F

        spark = local_session("spark-source-benchmark")
        spark.dataSource.register(ReliableSource)
        spark.dataSource.register(FloorSource)
        source = spark.readStream.format("reliable").option("url", f"embedded://{root / 'broker'}").option(
            "topic", "orders").load()
        two = spark.readStream.format("reliable").option("url", f"embedded://{root / 'broker'}").option(
            "topic", "orders").option("maxPartitions", 2).load()
        floor = spark.readStream.format("python-floor").option("rows", count).option("queues", 2).load()

        def parsed(stream: Any) -> Any:
            return stream.select(F.from_json("json", ROW_SCHEMA).alias("row")).select("row.*")

        streams = {
            "broker source, body": source,
            "broker source, body, maxPartitions=2": two,
            "file source, text": spark.readStream.text(str(root / "orders")),
            "python source floor, body": floor,
            "broker source, parsed (from_json)": parsed(source),
            "broker source, parsed, maxPartitions=2": parsed(two),
            "file source, json": spark.readStream.schema(ROW_SCHEMA).json(str(root / "orders")),
            "python source floor, parsed": parsed(floor),
        }
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in streams}
        for run in range(runs + 1):  # the streams in turn; round 0 warms up
            for number, (name, stream) in enumerate(streams.items()):
                seconds, batches, seen = timed_stream(stream, root / f"checkpoint-{run}-{number}")
                assert seen == count, (name, seen, count)
                if run:
                    timings[name].append((seconds, batches))
        spark.stop()
    rates = {name: count / statistics.median(s for s, _ in found) for name, found in timings.items()}
    batch_rates = {name: count / max(statistics.median(b for _, b in found), 1e-3) for name, found in timings.items()}
    print(f"{count} rows, local[2], median of {runs} timed rounds\n")
    print(f"{'':<40}{'query rows/s':>14}{'vs file':>9}{'batch rows/s':>14}{'vs file':>9}")
    for kind, peer in (("body", "file source, text"), ("parsed", "file source, json")):
        for name in [n for n in rates if n.startswith(("broker source, " + kind, "python source floor, " + kind))]:
            print(f"{name:<40}{rates[name]:>14,.0f}{rates[name] / rates[peer]:>8.2f}x"
                  f"{batch_rates[name]:>14,.0f}{batch_rates[name] / batch_rates[peer]:>8.2f}x")
        print(f"{peer:<40}{rates[peer]:>14,.0f}{'':>9}{batch_rates[peer]:>14,.0f}")
    print(f"{'broker read by position, no Spark':<40}{read_rate:>14,.0f}")


if __name__ == "__main__":
    main()
