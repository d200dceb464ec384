"""What a ``@foreach_batch`` function publishes (``tx.publish``) is sent from the Spark driver."""

from __future__ import annotations

import pytest

from reliable.spark import foreach_batch
from reliable.testing import test_app
from tests.spark.test_fence import as_query
from tests.waiting import wait_until

pytestmark = pytest.mark.spark


def test_the_first_batch_that_publishes_starts_a_relay_in_the_driver(spark, tmp_path, unique):
    app = test_app(tmp_path, transport=f"embedded://{tmp_path / 'broker'}")
    app.transport.declare(unique, [f"{unique}-loaded"])

    @foreach_batch(app, name=unique, token="order_id")
    def load(df, batch_id, tx):
        for row in df.collect():
            tx.publish(f"{unique}-loaded", {"order": row.order_id}, key=row.order_id)

    batch = spark.createDataFrame([(f"o{i}",) for i in range(3)], "order_id string")
    with as_query(spark, "run-1"):
        load(batch, 0)
    got = []
    try:
        with app.transport.subscribe(unique, [f"{unique}-loaded"]) as subscription:
            while len(got) < 3:
                messages = subscription.fetch(3, timeout=10.0)  # no worker, no drain: only a relay sends
                assert messages, f"{len(got)} of the batch's 3 messages were sent"
                subscription.ack(messages)
                got += messages
        assert sorted(m.body["order"] for m in got) == ["o0", "o1", "o2"]
        wait_until(lambda: app.store.outbox.status().sent == 3, "the relay marked the rows sent")
    finally:
        load.close()
        app.close()
