"""``sink="store"``: the claim is sent ahead of the function, betting the tokens are new; a lost
bet rolls the call back and the batch runs again in order, without the recorded rows."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from backends.store.postgresql import COPY_CLAIM_MIN
from reliable.spark import BatchStatus, foreach_batch, insert_rows
from reliable.testing import test_app
from tests.spark.test_fence import as_query

pytestmark = pytest.mark.spark

TTL = 3600.0
SCHEMA = "order_id string, amount long"


def written(app, table):
    with app.store.transaction() as tx:
        return tx.execute(text(f"SELECT order_id FROM {table} ORDER BY order_id")).scalars().all()


def create_table(app, table):
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {table} (order_id TEXT, amount BIGINT)"))


@pytest.fixture
def app(tmp_path, postgres_url, unique):
    """An app on PostgreSQL (the store that can send a claim ahead) with table ``unique``."""
    app = test_app(tmp_path, store=postgres_url)
    create_table(app, unique)
    yield app
    with app.store.transaction() as tx:
        tx.execute(text(f"DROP TABLE IF EXISTS {unique}"))
    app.close()


def counting_writer(app, table):
    """A ``sink="store"`` writer into ``table``, and the row count of each call it got."""
    calls: list[int] = []

    @foreach_batch(app, name=table, token="order_id", sink="store")
    def write(df, batch_id, tx):
        calls.append(df.count())
        insert_rows(df, tx, table)

    return write, calls


def large_batch(spark):
    """Rows enough for the in-order claim on PostgreSQL to use ``COPY`` (which a known token fails)."""
    rows = [(f"o{i:05d}", i) for i in range(COPY_CLAIM_MIN + 10)]
    return rows, spark.createDataFrame(rows, SCHEMA)


def test_a_token_recorded_behind_the_caches_back_loses_the_bet_and_is_not_written(
    spark, app, unique
):
    write, calls = counting_writer(app, unique)
    rows, batch = large_batch(spark)
    size = len(rows)
    with as_query(spark, "run-1"):
        first = write(batch.where("amount < 100"), 0)
        # recorded by another writer: the store knows it, the app's cache does not
        with app.store.transaction() as tx:
            tx.claim(unique, ["o00200"], TTL)
        second = write(batch.where("amount >= 100"), 1)

    assert (first.status, first.written, first.ahead) == (BatchStatus.COMMITTED, 100, True)
    assert (second.status, second.written, second.duplicates, second.ahead) == (
        BatchStatus.COMMITTED, size - 101, 1, False)  # fmt: skip
    # the bet on batch 1 was lost: that call rolled back, and the function was called again
    # without the recorded row
    assert calls == [100, size - 100, size - 101]
    assert written(app, unique) == [order for order, _ in rows if order != "o00200"]


def test_sqlite_runs_a_sink_store_batch_in_order(spark, tmp_path, unique):
    sqlite_app = test_app(tmp_path)
    create_table(sqlite_app, unique)
    write, calls = counting_writer(sqlite_app, unique)
    with sqlite_app.store.transaction() as tx:
        tx.claim(unique, ["b"], TTL)
    batch = spark.createDataFrame([("a", 1), ("b", 2), ("c", 3)], SCHEMA)
    with as_query(spark, "run-1"):
        report = write(batch, 0)

    assert (report.written, report.duplicates, report.ahead, calls) == (2, 1, False, [2])
    assert written(sqlite_app, unique) == ["a", "c"]


def wait_for_a_claim_blocked_on_a_row_lock(app, timeout=60.0):
    """Until a backend's token claim waits on another transaction's uncommitted row."""
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE 'INSERT INTO reliable_tokens%'"
    )
    deadline = time.monotonic() + timeout
    with app.store.engine.connect() as connection:
        while connection.execute(waiting).scalar_one() == 0:
            assert time.monotonic() < deadline, "the claim never waited on the twin's row"
            time.sleep(0.05)
            connection.rollback()  # a fresh snapshot of pg_stat_activity


def test_a_concurrent_twin_committing_while_the_claim_waits_loses_the_bet(spark, app, unique):
    write, calls = counting_writer(app, unique)
    rows, batch = large_batch(spark)
    size = len(rows)
    reports = []

    def run_batch():
        with as_query(spark, "run-1"):
            reports.append(write(batch, 0))

    with app.store.transaction() as twin:  # a handler of the same namespace, not yet committed
        twin.claim(unique, ["o00200"], TTL)
        writer = threading.Thread(target=run_batch)
        writer.start()
        wait_for_a_claim_blocked_on_a_row_lock(app)
    writer.join(120)  # the twin committed: the waiting claim fails on its row

    [report] = reports
    assert (report.written, report.duplicates, report.ahead) == (size - 1, 1, False)
    assert calls == [size, size - 1]  # the bet's call rolled back, then in order without it
    assert written(app, unique) == [order for order, _ in rows if order != "o00200"]


def test_the_function_cannot_keep_a_call_whose_bet_was_lost(spark, app, unique):
    with app.store.transaction() as tx:
        tx.claim(unique, ["b"], TTL)
    calls: list[list[str]] = []

    @foreach_batch(app, name=unique, token="order_id", sink="store")
    def write(df, batch_id, tx):
        calls.append(sorted(row.order_id for row in df.collect()))
        try:
            insert_rows(df, tx, unique)
        except Exception:  # noqa: BLE001 - a function that swallows everything
            pass

    batch = spark.createDataFrame([("a", 1), ("b", 2), ("c", 3)], SCHEMA)
    with as_query(spark, "run-1"):
        report = write(batch, 0)

    assert calls == [["a", "b", "c"], ["a", "c"]]
    assert (report.written, report.duplicates, report.ahead) == (2, 1, False)
    assert written(app, unique) == ["a", "c"]


def test_a_bet_drops_copies_and_tokens_known_to_the_cache_before_the_call(spark, app, unique):
    calls: list[list[str]] = []

    @foreach_batch(app, name=unique, token="order_id", sink="store")
    def write(df, batch_id, tx):
        calls.append(sorted(row.order_id for row in df.collect()))
        insert_rows(df, tx, unique)

    with as_query(spark, "run-1"):
        copies = write(spark.createDataFrame([("a", 1), ("a", 2), ("b", 3)], SCHEMA), 0)
        write.flush()  # the cache now knows a and b
        known = write(spark.createDataFrame([("b", 4), ("c", 5)], SCHEMA), 1)

    # each batch reached the function once, with one row per token the cache did not know
    assert calls == [["a", "b"], ["c"]]
    assert [(r.written, r.duplicates, r.ahead) for r in (copies, known)] == [
        (2, 0, True), (1, 1, True)]  # fmt: skip
    assert written(app, unique) == ["a", "b", "c"]


def test_a_failed_try_under_a_won_bet_leaves_nothing_and_is_retried(spark, app, unique):
    failures = [ConnectionResetError("the sink dropped the connection")]

    @foreach_batch(app, name=unique, token="order_id", sink="store")
    def write(df, batch_id, tx):
        insert_rows(df, tx, unique)
        if failures:
            raise failures.pop()

    with as_query(spark, "run-1"):
        report = write(spark.createDataFrame([("a", 1), ("b", 2)], SCHEMA), 0)

    assert (report.status, report.attempts, report.written, report.ahead) == (
        BatchStatus.COMMITTED, 2, 2, True)  # fmt: skip
    assert written(app, unique) == ["a", "b"]
    assert app.store.known(unique, ["a", "b"]) == {"a", "b"}
