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
