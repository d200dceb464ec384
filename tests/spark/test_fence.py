"""The batch fence: a batch re-run with the same id changes nothing; a reused name is reported."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import text

from reliable.errors import FenceConflictError
from reliable.spark import BatchStatus, foreach_batch, insert_rows
from reliable.spark.batch import prepare
from reliable.spark.fence import QUERY_ID_PROPERTY
from reliable.testing import test_app

pytestmark = pytest.mark.spark


@contextmanager
def as_query(spark: Any, query_id: str) -> Iterator[None]:
    """Call a batch function by hand as if streaming query ``query_id`` ran it."""
    spark.sparkContext.setLocalProperty(QUERY_ID_PROPERTY, query_id)
    try:
        yield
    finally:
        spark.sparkContext.setLocalProperty(QUERY_ID_PROPERTY, None)


def test_a_batch_rerun_with_the_same_id_changes_nothing(spark, tmp_path, unique):
    app = test_app(tmp_path)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount INTEGER, note TEXT)"))
    calls = []

    @foreach_batch(app, name=unique, token="order_id")
    def write(df, batch_id, tx):
        calls.append(batch_id)
        insert_rows(df, tx, unique)

    # 1 000 tokens, each in three rows spread over three tasks: 2 000 copies to drop
    rows = [(f"o{i % 1000:04d}", i, "") for i in range(3000)]
    batch = spark.createDataFrame(rows, "order_id string, amount long, note string").repartition(3)
    with as_query(spark, "run-1"):
        first = write(batch, 0)
        again = write(batch, 0)

    assert first.status is BatchStatus.COMMITTED and first.written == 1000
    assert first.cached  # after a shuffle a second read may order the rows differently
    assert again.status is BatchStatus.REPLAYED
    assert calls == [0]  # the replay never reached the user's function
    with app.store.transaction() as tx:
        written = (
            tx.execute(text(f"SELECT order_id FROM {unique} ORDER BY order_id")).scalars().all()
        )
    assert written == [f"o{i:04d}" for i in range(1000)]  # each token once

    with as_query(spark, "run-2"), pytest.raises(FenceConflictError, match="fresh checkpoint"):
        write(batch, 0)  # a fresh checkpoint (new query id) reusing the name


def test_rows_of_known_tokens_are_dropped_however_many_there_are(spark, tmp_path, unique):
    """Known tokens are filtered by IN, a broadcast anti-join or a broadcast semi-join on the
    claimed ones, whichever is smaller; every path must keep exactly the new rows."""
    app = test_app(tmp_path)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount INTEGER, note TEXT)"))

    @foreach_batch(app, name=unique, token="order_id")
    def write(df, batch_id, tx):
        insert_rows(df, tx, unique)

    def batch(first: int, last: int) -> Any:
        rows = [(f"o{i:05d}", i, "") for i in range(first, last)]
        return spark.createDataFrame(rows, "order_id string, amount long, note string")

    seen = 0
    with as_query(spark, "run-1"):
        for batch_id, last in enumerate((1000, 2500, 2501, 3600, 7300, 7300)):
            # 1000 known / 1500 new (IN), 2500 / 1 (keep by IN), 2501 / 1099 (keep by a
            # broadcast semi-join), 3600 / 3700 (broadcast anti-join), 7300 / 0 (nothing)
            report = write(batch(0, last), batch_id)
            assert (report.written, report.duplicates) == (last - seen, seen), batch_id
            seen = last
    with app.store.transaction() as tx:
        written = tx.execute(text(f"SELECT order_id FROM {unique} ORDER BY order_id")).scalars()
        assert list(written) == [f"o{i:05d}" for i in range(7300)]


def test_rows_are_cached_only_when_a_second_read_could_differ(spark):
    rows = spark.createDataFrame(
        [("a", 1, ""), ("b", 2, ""), ("a", 3, "")], "order_id string, amount long, note string"
    )
    cases = {
        "read again": (rows, {}),
        "after a shuffle": (rows.repartition(2), {}),
        "asked for": (rows, {"cache": True}),
        "validated once": (rows, {"validate": dict}),
    }
    cached = {}
    for case, (frame, options) in cases.items():
        prepared = prepare(frame, token="order_id", **options)
        cached[case] = prepared.cached
        assert sorted(prepared.tokens) == ["a", "b"] and prepared.copies, case
        assert sorted(r.order_id for r in prepared.rows().collect()) == ["a", "b"], case
        prepared.release()
    assert cached == {"read again": False, "after a shuffle": True, "asked for": True,
                      "validated once": True}  # fmt: skip
