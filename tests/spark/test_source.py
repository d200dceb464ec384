"""The broker as a Spark streaming source: exact ranges, admission control, commits to the group."""

from __future__ import annotations

import json

import pytest

from broker.delivery.values import OutgoingMessage
from broker.embedded import open_embedded
from reliable.spark.source import ReliableSource

pytestmark = pytest.mark.spark


def test_every_message_once_in_batches_of_at_most_the_limit_and_the_group_follows(spark, tmp_path, unique):
    directory = tmp_path / "broker"
    broker = open_embedded(directory)  # this process owns it; Spark's executors reach it by socket
    bodies = [{"n": n} for n in range(1000)]
    broker.publish(unique, [OutgoingMessage(json.dumps(b).encode(), key=f"k{n % 7}", message_id=f"m{n}",
                                            headers={"content-type": "application/json"})
                            for n, b in enumerate(bodies)])
    spark.dataSource.register(ReliableSource)
    batches: list[tuple[int, int, list[int]]] = []

    def collect(df, batch_id):  # type: ignore[no-untyped-def]
        rows = df.select("offset", "json", "queue", "message_id").collect()
        batches.append((batch_id, len(rows), sorted(json.loads(r.json)["n"] for r in rows)))

    stream = (spark.readStream.format("reliable").option("url", f"embedded://{directory}")
              .option("topic", unique).option("group", "spark").option("maxRowsPerBatch", 300).load())
    query = (stream.writeStream.foreachBatch(collect)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    assert [size for _, size, _ in batches] == [300, 300, 300, 100]  # admission control
    seen = sorted(n for _, _, numbers in batches for n in numbers)
    assert seen == list(range(1000))  # every message once
    # Spark commits a range to the source when it plans the next batch: the group is at the
    # end of batch 2, and a new query of the group would read batch 3 again
    assert sum(broker.group_offsets("spark", unique)) == 900

    broker.publish(unique, [OutgoingMessage(b'{"n": 1000}', message_id="m1000",
                                            headers={"content-type": "application/json"})])
    restarted = (stream.writeStream.foreachBatch(collect)
                 .option("checkpointLocation", str(tmp_path / "checkpoint"))
                 .trigger(availableNow=True).start())
    restarted.awaitTermination()
    assert batches[-1][2] == [1000]  # the restart reads on from its checkpoint
    assert sum(broker.group_offsets("spark", unique)) == 1000  # planning it committed batch 3

    fresh = (stream.writeStream.foreachBatch(collect)  # a new checkpoint: the group's offsets
             .option("checkpointLocation", str(tmp_path / "fresh-checkpoint"))
             .trigger(availableNow=True).start())
    fresh.awaitTermination()
    assert batches[-1][2] == [1000]  # the replay the commit timing implies: the same row again
    broker.close()


def test_options_come_from_the_settings_file_and_bad_ones_are_named(tmp_path):
    from backends.errors import ConfigurationError
    from reliable.spark.source import ReliableStreamReader, share

    settings = tmp_path / "reliable.toml"
    settings.write_text('[transport]\nurl = "reliable://broker.internal:7600"\n')
    reader = ReliableStreamReader({"settings": str(settings), "topic": "orders"})
    assert reader.url == "reliable://broker.internal:7600"
    with pytest.raises(ConfigurationError, match="topic"):
        ReliableStreamReader({"url": "embedded://x"})
    with pytest.raises(ConfigurationError, match="maxRowsPerBatch"):
        ReliableStreamReader({"url": "embedded://x", "topic": "t", "maxRowsPerBatch": "lots"})
    # admission control shares the rows fairly and never passes the end of a queue
    assert share({"q0": 0, "q1": 0, "q2": 5}, {"q0": 100, "q1": 3, "q2": 5}, 10) == {"q0": 7, "q1": 3, "q2": 5}


def test_max_partitions_reads_every_queue_in_fewer_tasks(spark, tmp_path, unique):
    """``maxPartitions`` below the queue count: a partition reads several queues' ranges one
    after another, the rows shared about evenly, every message once."""
    from backends.errors import ConfigurationError
    from reliable.spark.source import QueueRanges, ReliableStreamReader

    reader = ReliableStreamReader({"url": "embedded://x", "topic": "t", "maxPartitions": "2"})
    parts = reader.partitions({"q0": 0, "q1": 0, "q2": 0, "q3": 10}, {"q0": 90, "q1": 40, "q2": 50, "q3": 10})
    assert [[(r.queue, r.start, r.end) for r in part.ranges] for part in parts] == [
        [(0, 0, 90)], [(1, 0, 40), (2, 0, 50)]]  # q3 has no rows in the range
    assert all(isinstance(part, QueueRanges) for part in parts)
    with pytest.raises(ConfigurationError, match="maxPartitions"):
        ReliableStreamReader({"url": "embedded://x", "topic": "t", "maxPartitions": "0"})

    directory = tmp_path / "broker"
    broker = open_embedded(directory)
    broker.publish(unique, [OutgoingMessage(json.dumps({"n": n}).encode(), key=f"k{n}") for n in range(400)])
    assert sum(1 for first, end in broker.queue_offsets(unique) if end > first) > 1
    spark.dataSource.register(ReliableSource)
    seen: list[tuple[int, list[int]]] = []

    def collect(df, batch_id):  # type: ignore[no-untyped-def]
        seen.append((df.rdd.getNumPartitions(), [json.loads(r.body)["n"] for r in df.select("body").collect()]))

    stream = (spark.readStream.format("reliable").option("url", f"embedded://{directory}")
              .option("topic", unique).option("maxPartitions", 1).load())
    query = (stream.writeStream.foreachBatch(collect).option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    assert [tasks for tasks, _ in seen] == [1]
    assert sorted(n for _, numbers in seen for n in numbers) == list(range(400))
    broker.close()


def test_a_read_becomes_one_arrow_batch_of_the_schema_spark_checks(spark, tmp_path):
    """The executors' conversion: Spark's own Arrow schema for `SCHEMA`, keys and tags "" as null,
    ``json`` only where the content type says JSON and the body is text, one map per row."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    from reliable.spark.arrow import ARROW_SCHEMA, SCHEMA, record_batch

    assert to_arrow_schema(StructType.fromDDL(SCHEMA), timezone="UTC").equals(ARROW_SCHEMA)
    broker = open_embedded(tmp_path / "broker")
    json_header = {"content-type": "application/json"}
    broker.publish("mixed", [OutgoingMessage(b'{"n": 1}', key="k", tag="t", headers=json_header, queue=0),
                             OutgoingMessage(b"\xff not text", headers=json_header, queue=0),
                             OutgoingMessage(b'{"n": 3}', queue=0)])
    broker.publish("same", [OutgoingMessage(f'{{"n": {n}}}'.encode(), headers=json_header, queue=0)
                            for n in range(5)])
    mixed = broker.read_columns("mixed", 0, 0, 10)
    rows = record_batch(mixed.count, dict(mixed.same), dict(mixed.columns)).to_pylist()
    assert [(r["key"], r["tag"], r["json"], dict(r["headers"])) for r in rows] == [
        ("k", "t", '{"n": 1}', json_header), (None, None, None, json_header), (None, None, None, {})]
    expected = broker.read("mixed", 0, 0, 10)
    assert [(r["offset"], r["message_id"], r["body"], r["delivery_count"]) for r in rows] == [
        (d.offset, d.message_id, d.body, d.delivery_count) for d in expected]
    assert [r["published_at"].timestamp() for r in rows] == pytest.approx([d.published_at for d in expected])
    same = broker.read_columns("same", 0, 0, 10)
    batch = record_batch(same.count, dict(same.same), dict(same.columns))
    assert batch.schema.equals(ARROW_SCHEMA)
    assert [json.loads(text)["n"] for text in batch.column("json").to_pylist()] == list(range(5))
    assert [dict(h) for h in batch.column("headers").to_pylist()] == [json_header] * 5
    broker.close()
