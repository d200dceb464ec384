"""Poison rows go to the dead-letter table while good rows commit; spent retries dead-letter a batch."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text

from backends.clock import FakeClock
from backends.store.schema import TOKEN_MAX
from reliable.retry import RedeliveryPolicy
from reliable.spark import BatchStatus, foreach_batch, insert_rows, read_dead_letters
from reliable.testing import test_app

pytestmark = pytest.mark.spark

SCHEMA = "order_id string, amount long, note string"


def parse_order(row: dict) -> dict:
    """The per-row validate step: amounts must be positive; amounts become cents."""
    if row["amount"] is None or row["amount"] <= 0:
        raise ValueError(f"amount must be positive, got {row['amount']}")
    cents = "a lot" if row["note"] == "not a number" else row["amount"] * 100  # Arrow refuses it
    return {"order_id": row["order_id"], "cents": cents}


def checkpoint_of(tmp_path, query_id: str) -> str:
    """A checkpoint folder as Spark leaves it: ``metadata`` holds the query id."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "metadata").write_text(json.dumps({"id": query_id}) + "\n")
    return str(folder)


@pytest.mark.parametrize(("sink", "backend"), [("any", "sqlite"), ("store", "postgresql")])
def test_poison_rows_land_in_the_dead_letter_table_while_good_rows_commit(
    spark, tmp_path, unique, sink, backend, request
):
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, store=store)
    table, dlq = unique, f"{unique}_dlq"
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {table} (order_id TEXT, cents INTEGER)"))

    @foreach_batch(
        app,
        name=table,
        token="order_id",
        validate=parse_order,
        schema="order_id string, cents long",
        dead_letters=dlq,
        checkpoint_location=checkpoint_of(tmp_path, "query-1"),
        sink=sink,
    )
    def write(df, batch_id, tx):
        insert_rows(df, tx, table)

    batch = spark.createDataFrame(
        [
            ("a", 5, ""),
            ("b", -1, "refund?"),
            (None, 3, "no token"),
            ("c", 7, ""),
            ("b", -1, "dup"),
            ("d", 9, "not a number"),
        ],
        SCHEMA,
    )
    report = write(batch, 4)

    assert (report.status, report.written, report.poison) == (BatchStatus.COMMITTED, 2, 3)
    assert report.ahead is (sink == "store")  # the claim went ahead of the function
    with app.store.transaction() as tx:
        written = tx.execute(text(f"SELECT order_id, cents FROM {table} ORDER BY order_id")).all()
    assert [tuple(row) for row in written] == [("a", 500), ("c", 700)]
    letters = {d.token: d for d in read_dead_letters(app.store, dlq, name=table)}
    assert {(d.batch_id, d.run_id, d.scope) for d in letters.values()} == {(4, "query-1", "row")}
    assert (
        letters[None].error_type == "TokenMissingError" and letters[None].row["note"] == "no token"
    )
    assert letters["b"].error_type == "ValueError"  # once, though the batch held it twice
    assert letters["b"].error_message == "amount must be positive, got -1"
    assert letters["b"].row["amount"] == -1
    assert letters["d"].error_type.startswith(
        "Arrow"
    )  # validate returned what the schema cannot hold
    assert app.store.known(table, ["a", "b", "c", "d"]) == {"a", "c"}  # poison claims no token

    assert write(batch, 4).status is BatchStatus.REPLAYED
    assert len(read_dead_letters(app.store, dlq, name=table)) == 3  # not dead-lettered twice

    later = spark.createDataFrame(
        [("a", -1, "a bad copy of a written row"), ("c", 7, ""), ("e", 2, ""), ("b", 4, "fixed")],
        SCHEMA,
    )
    report = write(later, 5)
    # a and c were written by batch 4: duplicates, even the bad copy of a (not poison);
    # b was poison, so its token was never recorded and the corrected row goes through
    assert (report.written, report.duplicates, report.poison) == (2, 1, 0)
    with app.store.transaction() as tx:
        written = tx.execute(text(f"SELECT order_id FROM {table} ORDER BY order_id")).scalars()
        assert list(written) == ["a", "b", "c", "e"]
    assert len(read_dead_letters(app.store, dlq, name=table)) == 3
    with app.store.transaction() as tx:
        tx.execute(text(f"DROP TABLE {table}"))
        tx.execute(text(f"DROP TABLE {dlq}"))


def test_rows_without_a_token_are_dead_lettered_without_a_validate_step(spark, tmp_path, unique):
    app = test_app(tmp_path)
    table, dlq = unique, f"{unique}_dlq"
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {table} (order_id TEXT, amount INTEGER, note TEXT)"))

    @foreach_batch(app, name=table, token="order_id", dead_letters=dlq,
                   checkpoint_location=checkpoint_of(tmp_path, "query-1"))  # fmt: skip
    def write(df, batch_id, tx):
        insert_rows(df, tx, table)

    rows = [("a", 1, ""), (None, 2, "no token"), ("a", 3, "copy"), (None, 4, "none either")]
    report = write(spark.createDataFrame(rows, SCHEMA).repartition(2), 0)

    assert (report.written, report.poison) == (1, 2)
    with app.store.transaction() as tx:
        assert tx.execute(text(f"SELECT order_id FROM {table}")).scalars().all() == ["a"]
    letters = read_dead_letters(app.store, dlq, name=table)
    assert sorted((d.token, d.error_type, d.row["amount"], d.row["note"]) for d in letters) == [
        (None, "TokenMissingError", 2, "no token"),
        (None, "TokenMissingError", 4, "none either"),
    ]
    assert letters[0].error_message == "the token column 'order_id' is null"


def test_spent_retries_dead_letter_the_whole_batch_with_backoff_on_the_clock(
    spark, tmp_path, unique
):
    clock = FakeClock()
    app = test_app(tmp_path, clock=clock)
    policy = RedeliveryPolicy(initial_delay=1.0, multiplier=2.0, max_redeliveries=2)
    attempts = []

    @foreach_batch(
        app,
        name=unique,
        token="order_id",
        retry=policy,
        dead_letters=f"{unique}_dlq",
        on_retries_spent="dead_letter",
        checkpoint_location=checkpoint_of(tmp_path, "query-1"),
    )
    def write(df, batch_id, tx):
        attempts.append(df.count())
        raise ConnectionError("sink is down")

    report = write(spark.createDataFrame([("a", 1, ""), ("b", 2, ""), ("a", 1, "")], SCHEMA), 0)

    assert report.status is BatchStatus.DEAD_LETTERED and report.attempts == 3
    assert attempts == [2, 2, 2]
    assert clock.sleeps == [1.0, 2.0]  # the redelivery policy's backoff, on the injected clock
    letters = read_dead_letters(app.store, f"{unique}_dlq", name=unique)
    assert sorted((d.token, d.scope, d.error_type) for d in letters) == [
        ("a", "batch", "ConnectionError"),
        ("b", "batch", "ConnectionError"),
    ]
    assert "sink is down" in letters[0].error_message
    assert app.store.known(unique, ["a", "b"]) == set()  # left unclaimed: the rows can be replayed

def test_a_bad_copy_in_one_task_does_not_reach_the_function_when_another_task_passed_the_token(
    spark, tmp_path, unique
):
    app = test_app(tmp_path)
    table = unique
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {table} (order_id TEXT, cents INTEGER)"))

    @foreach_batch(app, name=table, token="order_id", validate=parse_order,
                   schema="order_id string, cents long", dead_letters=f"{unique}_dlq",
                   checkpoint_location=checkpoint_of(tmp_path, "query-1"))  # fmt: skip
    def write(df, batch_id, tx):
        insert_rows(df, tx, table)

    tasks = [("e", -2, "bad copy"), ("f", 1, ""), ("e", 4, "good copy"), ("g", 2, "")]
    batch = spark.createDataFrame(spark.sparkContext.parallelize(tasks, 2), SCHEMA)  # 2 per task
    report = write(batch, 0)

    # the bad copy is not poison (its token was passed on), and its row, which carries
    # no data, is not handed to the function either
    assert (report.written, report.poison) == (3, 0)
    with app.store.transaction() as tx:
        written = tx.execute(text(f"SELECT order_id, cents FROM {table} ORDER BY order_id")).all()
    assert [tuple(row) for row in written] == [("e", 400), ("f", 100), ("g", 200)]
    assert read_dead_letters(app.store, f"{unique}_dlq", name=table) == []


@pytest.mark.parametrize("validate", [None, parse_order], ids=["without validate", "with validate"])
def test_a_token_the_store_cannot_record_is_dead_lettered_without_it(spark, tmp_path, unique, postgres_url, validate):
    """PostgreSQL refuses a token wider than its column or holding a NUL: the claim of such a
    row failed the whole batch, again on every retry of the query."""
    app = test_app(tmp_path, store=postgres_url)
    table, dlq = unique, f"{unique}_dlq"
    options = {"validate": validate, "schema": "order_id string, cents long"} if validate else {}
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {table} (order_id TEXT, {'cents' if validate else 'amount'} INTEGER"
                        f"{'' if validate else ', note TEXT'})"))

    @foreach_batch(app, name=table, token="order_id", dead_letters=dlq,
                   checkpoint_location=checkpoint_of(tmp_path, "query-1"), **options)  # fmt: skip
    def write(df, batch_id, tx):
        insert_rows(df, tx, table)

    rows = [("a", 1, ""), ("x" * (TOKEN_MAX + 1), 2, "too long"), ("b\x00c", 3, "a NUL")]
    report = write(spark.createDataFrame(rows, SCHEMA).repartition(2), 0)

    assert (report.written, report.poison) == (1, 2)
    with app.store.transaction() as tx:
        assert tx.execute(text(f"SELECT order_id FROM {table}")).scalars().all() == ["a"]
    letters = sorted(read_dead_letters(app.store, dlq, name=table), key=lambda d: d.row["amount"])
    assert [(d.token, d.error_type, d.row["amount"]) for d in letters] == [
        (None, "TokenInvalidError", 2), (None, "TokenInvalidError", 3)]
    assert f"is {TOKEN_MAX + 1} characters long; at most {TOKEN_MAX}" in letters[0].error_message
    assert letters[1].row["order_id"] == "b\x00c"  # the row as it came, in the record's JSON
    with app.store.transaction() as tx:
        tx.execute(text(f"DROP TABLE {table}"))
        tx.execute(text(f"DROP TABLE {dlq}"))
