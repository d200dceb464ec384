"""On PostgreSQL (and a Redis cache the driver asks first): duplicates are written once;
a failed try leaves nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from backends.clock import FakeClock
from reliable.retry import RedeliveryPolicy
from reliable.spark import BatchStatus, foreach_batch, insert_rows
from reliable.testing import test_app
from tests.spark.streams import order, run_stream, write_orders

pytestmark = pytest.mark.spark


def test_duplicate_tokens_across_and_within_batches_are_written_once(
    spark, tmp_path, postgres_url, redis_url, unique
):
    clock = FakeClock()
    app = test_app(tmp_path, clock=clock, store=postgres_url, cache=redis_url)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount BIGINT, note TEXT)"))
    source = tmp_path / "in"
    write_orders(source, "0", [order("o1"), order("o2"), order("o2", note="dup"), order("o3")])
    write_orders(
        source,
        "1",
        [
            order("o3", note="dup"),
            order("o4"),
            order("o1", note="dup"),
            order("o5"),
            order("o5", note="dup"),
        ],
    )
    write_orders(source, "2", [order("o6"), order("o2", note="dup"), order("o9")])
    app.cache.remember(unique, ["o9"], 3600)  # known to the cache only: a duplicate all the same
    failures = {1: 1}  # batch 1 fails once, after its rows were inserted

    @foreach_batch(
        app,
        name=unique,
        token="order_id",
        retry=RedeliveryPolicy(initial_delay=0.5, multiplier=2.0, max_redeliveries=3),
    )
    def write(df, batch_id, tx):
        insert_rows(df, tx, unique)
        if failures.get(batch_id):
            failures[batch_id] -= 1
            raise ConnectionResetError("the sink dropped the connection")

    reports = []
    run_stream(
        spark,
        source,
        tmp_path / "checkpoint",
        lambda df, batch_id: reports.append(write(df, batch_id)),
    )

    assert [(r.batch_id, r.status, r.written, r.duplicates, r.attempts) for r in reports] == [
        (0, BatchStatus.COMMITTED, 3, 0, 1),
        (1, BatchStatus.COMMITTED, 2, 2, 2),
        (2, BatchStatus.COMMITTED, 1, 2, 1),
    ]
    assert clock.sleeps == [0.5]
    assert not any(r.cached for r in reports)  # a file source gives a batch the same rows again
    with app.store.transaction() as tx:
        rows = tx.execute(
            text(f"SELECT order_id, count(*) FROM {unique} GROUP BY order_id ORDER BY 1")
        ).all()
        tx.execute(text(f"DROP TABLE {unique}"))
    assert [tuple(row) for row in rows] == [(f"o{i}", 1) for i in range(1, 7)]
    assert app.store.known(unique, [f"o{i}" for i in range(1, 8)]) == {f"o{i}" for i in range(1, 7)}
    write.flush()  # the cache is filled behind the batches
    assert app.cache.seen(unique, ["o1", "o6", "o7"]) == {"o1", "o6"}  # every committed token
