"""Streaming queries end to end: crash after the sink write and restart; duplicates written once."""

from __future__ import annotations

import pytest
from pyspark.errors import StreamingQueryException
from sqlalchemy import text

from reliable.spark import BatchStatus, foreach_batch, insert_rows
from reliable.testing import test_app
from tests.spark.streams import order, run_stream, write_orders

pytestmark = pytest.mark.spark


class Crash(Exception):
    """The driver dies right after a batch committed, before Spark records the batch as done."""


def orders_in(app, table):
    with app.store.transaction() as tx:
        return tx.execute(text(f"SELECT order_id FROM {table} ORDER BY order_id")).scalars().all()


def make_writer(app, table, reports, crash_after=None, sink="any"):
    @foreach_batch(app, name=table, token="order_id", sink=sink)
    def write(df, batch_id, tx):
        insert_rows(df, tx, table)

    def batch_function(df, batch_id):
        reports.append(write(df, batch_id))
        if crash_after is not None and batch_id == crash_after:
            raise Crash(f"killed after batch {batch_id} was written")

    return batch_function


@pytest.mark.parametrize(("sink", "backend"), [("any", "sqlite"), ("store", "postgresql")])
def test_killed_after_the_sink_write_and_restarted_writes_no_duplicates(
    spark, tmp_path, unique, sink, backend, request
):
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, store=store)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount INTEGER, note TEXT)"))
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    write_orders(source, "0", [order("o1"), order("o2")])  # all new: sink="store" bets on it
    write_orders(source, "1", [order("o2", note="dup across"), order("o3"),
                               order("o3", note="dup in batch"), order("o4")])  # fmt: skip
    write_orders(source, "2", [order("o4", note="dup across"), order("o5")])

    first_run: list = []
    with pytest.raises(StreamingQueryException, match="killed after batch 1"):
        run_stream(spark, source, checkpoint, make_writer(app, unique, first_run, 1, sink))
    assert [r.status for r in first_run] == [BatchStatus.COMMITTED] * 2
    assert first_run[0].ahead is (sink == "store")  # all new: the claim went ahead
    assert orders_in(app, unique) == ["o1", "o2", "o3", "o4"]

    restarted: list = []
    run_stream(spark, source, checkpoint, make_writer(app, unique, restarted, sink=sink))
    # Spark replays batch 1 (its commit was never recorded); the fence skips it.
    assert [(r.batch_id, r.status) for r in restarted] == [
        (1, BatchStatus.REPLAYED),
        (2, BatchStatus.COMMITTED),
    ]
    assert orders_in(app, unique) == ["o1", "o2", "o3", "o4", "o5"]
    assert restarted[-1].run_id == first_run[0].run_id  # the query id survived the restart

    fresh: list = []
    with pytest.raises(StreamingQueryException, match="FenceConflictError"):
        run_stream(spark, source, tmp_path / "fresh-checkpoint", make_writer(app, unique, fresh))
    assert orders_in(app, unique) == ["o1", "o2", "o3", "o4", "o5"]
    with app.store.transaction() as tx:
        tx.execute(text(f"DROP TABLE {unique}"))
