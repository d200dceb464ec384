"""A claim sent ahead in a PostgreSQL pipeline (`ClaimAhead`) and the function's view of the
transaction behind it (`ClaimFirst`): bulk writes ride the pipeline, anything else waits for
the claim; a claim that did not go through always ends in `LostBet` and a rollback."""

from __future__ import annotations

import pytest
from sqlalchemy import column, select, table, text

from backends.store.ahead import rides_pipeline
from reliable.spark.ahead import LostBet, call_ahead_of_claim
from reliable.testing import test_app

TTL = 3600.0


@pytest.fixture
def store(tmp_path, postgres_url, unique):
    app = test_app(tmp_path, store=postgres_url)
    with app.store.transaction() as tx:
        tx.execute(text(f"CREATE TABLE {unique} (order_id TEXT PRIMARY KEY, amount BIGINT)"))
    yield app.store
    with app.store.transaction() as tx:
        tx.execute(text(f"DROP TABLE {unique}"))
    app.close()


def orders(name):
    return table(name, column("order_id"), column("amount"))


def rows(*ids):
    return [{"order_id": order_id, "amount": n} for n, order_id in enumerate(ids)]


def written(store, name):
    with store.transaction() as tx:
        return tx.execute(text(f"SELECT order_id FROM {name} ORDER BY 1")).scalars().all()


def run(store, name, tokens, call):
    """One transaction: the claim of ``tokens`` sent ahead, then ``call(tx)``."""
    with store.transaction() as tx:
        claim = tx.claim_ahead(name, tokens, TTL)
        return call_ahead_of_claim(call, tx, claim)


def test_bulk_writes_ride_the_pipeline_and_commit_with_the_claim(store, unique):
    def call(tx):
        tx.execute(orders(unique).insert(), rows("a", "b", "c"))
        tx.execute(orders(unique).insert(), rows("d", "e"))

    assert run(store, unique, ["c", "a", "b", "e", "d", "a"], call) == {"a", "b", "c", "d", "e"}
    assert written(store, unique) == ["a", "b", "c", "d", "e"]
    assert store.known(unique, ["a", "e", "z"]) == {"a", "e"}


def test_a_read_waits_for_the_claim_and_sees_the_rows_written_before_it(store, unique):
    seen = []

    def call(tx):
        tx.execute(orders(unique).insert(), rows("a", "b"))
        seen.extend(tx.execute(select(orders(unique).c.order_id)).scalars())
        tx.execute(orders(unique).insert(), rows("c"))  # one row: not a bulk write, in order

    assert run(store, unique, ["a", "b", "c"], call) == {"a", "b", "c"}
    assert sorted(seen) == ["a", "b"]
    assert written(store, unique) == ["a", "b", "c"]


@pytest.mark.parametrize("function", ["propagates", "swallows", "wraps", "reads"])
def test_a_token_with_a_row_loses_the_bet_whatever_the_function_does(store, unique, function):
    with store.transaction() as tx:
        tx.claim(unique, ["b"], TTL)

    def call(tx):
        try:
            tx.execute(orders(unique).insert(), rows("a", "b", "c"))
            if function == "reads":
                tx.execute(select(orders(unique).c.order_id)).all()
        except Exception as exc:
            if function == "swallows":
                return
            if function == "wraps":
                raise RuntimeError("the sink failed") from exc
            raise

    with pytest.raises(LostBet):
        run(store, unique, ["a", "b", "c"], call)
    assert written(store, unique) == []  # rolled back with the claim
    assert store.known(unique, ["a", "b", "c"]) == {"b"}


def test_the_functions_own_failure_stands_when_the_claim_went_through(store, unique):
    with store.transaction() as tx:
        tx.execute(orders(unique).insert(), rows("b"))

    def call(tx):
        tx.execute(orders(unique).insert(), rows("a", "b"))  # the sink's own key refuses "b"

    with pytest.raises(Exception, match="orders|duplicate key|unique") as raised:
        run(store, unique, ["x", "y"], call)
    assert not isinstance(raised.value, LostBet)
    assert store.known(unique, ["x", "y"]) == set()  # rolled back
    assert written(store, unique) == ["b"]


def test_an_interrupt_stays_an_interrupt(store, unique):
    def call(tx):
        tx.execute(orders(unique).insert(), rows("a", "b"))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(store, unique, ["a", "b"], call)
    assert written(store, unique) == [] and store.known(unique, ["a"]) == set()


def test_tokens_holding_line_breaks_are_claimed_as_they_are(store, unique):
    tokens = ["line\nbreak", "tab\there", "plain"]
    assert run(store, unique, tokens, lambda tx: None) == set(tokens)
    assert store.known(unique, tokens) == set(tokens)


def test_only_bulk_writes_that_return_nothing_ride_the_pipeline():
    target = orders("t")
    assert rides_pipeline(target.insert(), rows("a", "b"))
    assert rides_pipeline(target.delete().where(target.c.order_id == "x"), rows("a", "b"))
    assert not rides_pipeline(target.insert(), rows("a"))  # one row
    assert not rides_pipeline(target.insert(), None)
    assert not rides_pipeline(target.insert().returning(target.c.order_id), rows("a", "b"))
    assert not rides_pipeline(select(target.c.order_id), rows("a", "b"))
    assert not rides_pipeline(text("INSERT INTO t VALUES (:order_id, :amount)"), rows("a", "b"))


def test_sqlite_sends_no_claim_ahead(tmp_path):
    app = test_app(tmp_path)
    with app.store.transaction() as tx:
        assert tx.claim_ahead("n", ["a"], TTL) is None
