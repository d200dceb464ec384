"""``sink="store"``: the claim runs beside the function; a token found already recorded rolls
the call back and the function is called again without its row."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from backends.store.tokens import COPY_CLAIM_MIN
from reliable.spark import BatchStatus, foreach_batch, insert_rows
from reliable.testing import test_app
from tests.spark.test_fence import as_query

pytestmark = pytest.mark.spark

TTL = 3600.0


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_token_recorded_behind_the_caches_back_rolls_the_call_back(
    spark, tmp_path, unique, postgres_url, backend
):
    app = test_app(tmp_path, store=postgres_url if backend == "postgresql" else None)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount BIGINT)"))
    calls: list[int] = []

    @foreach_batch(app, name=unique, token="order_id", sink="store")
    def write(df, batch_id, tx):
        calls.append(df.count())
        insert_rows(df, tx, unique)

    size = COPY_CLAIM_MIN + 10  # PostgreSQL claims it with COPY, which a known token fails
    rows = [(f"o{i:05d}", i) for i in range(size)]
    batch = spark.createDataFrame(rows, "order_id string, amount long")
    with as_query(spark, "run-1"):
        first = write(batch.where("amount < 100"), 0)
        assert (first.status, first.written, calls) == (BatchStatus.COMMITTED, 100, [100])
        # recorded by another writer: the store knows it, the app's cache does not
        with app.store.transaction() as tx:
            tx.claim(unique, ["o00200"], TTL)
        second = write(batch, 1)

    # 100 known to the cache (never passed on), 1 found by the claim beside the function:
    # that call was rolled back and the function called again without the row
    assert (second.written, second.duplicates) == (size - 101, 101)
    assert calls == [100, size - 100, size - 101]
    with app.store.transaction() as tx:
        written = tx.execute(text(f"SELECT order_id FROM {unique} ORDER BY order_id")).scalars()
        assert list(written) == [order for order, _ in rows if order != "o00200"]
        tx.execute(text(f"DROP TABLE {unique}"))


def test_the_function_cannot_keep_a_call_the_claim_refused(spark, tmp_path, unique):
    app = test_app(tmp_path)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount BIGINT)"))
        tx.claim(unique, ["b"], TTL)
    calls: list[list[str]] = []

    @foreach_batch(app, name=unique, token="order_id", sink="store")
    def write(df, batch_id, tx):
        orders = sorted(row.order_id for row in df.collect())
        calls.append(orders)
        try:
            insert_rows(df, tx, unique)
        except Exception:  # noqa: BLE001 - a function that swallows everything
            pass

    batch = spark.createDataFrame([("a", 1), ("b", 2), ("c", 3)], "order_id string, amount long")
    with as_query(spark, "run-1"):
        report = write(batch, 0)

    assert calls == [["a", "b", "c"], ["a", "c"]]
    assert (report.written, report.duplicates) == (2, 1)
    with app.store.transaction() as tx:
        written = tx.execute(text(f"SELECT order_id FROM {unique} ORDER BY order_id")).scalars()
        assert list(written) == ["a", "c"]
