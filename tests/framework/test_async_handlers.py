"""`async def` handlers on the one pipeline: awaited writes in the claim's transaction, many
messages in flight on one event loop, one key in order, and every failure path as for sync."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

import reliable
from reliable import App, Message
from reliable.commit import STRATEGIES
from reliable.testing import dead_letter_queue, test_app
from tests.transports.effects import effect_counts

from .conftest import pending


class Transient(Exception):
    pass


@pytest.fixture
def pg_effects(postgres_url: str, unique: str) -> Iterator[str]:
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null, attempt integer)"))
    yield unique
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}"))
    engine.dispose()


async def insert(tx, table: str, token: str, attempt: int = 1) -> None:
    await tx.execute(text(f"insert into {table} (token, attempt) values (:t, :a)"), {"t": token, "a": attempt})


def sqlite_counts(app: App, table: str) -> dict[str, int]:
    with app.store.transaction() as tx:
        rows = tx.execute(text(f"select token, count(*) from {table} group by token"))
        return {token: count for token, count in rows}


@pytest.mark.parametrize("store", ["sqlite", "postgresql+redis"])
def test_ten_thousand_messages_fifty_in_flight_duplicates_and_poison(
    tmp_path, store, request, unique
) -> None:
    """10,000 messages, 10% duplicate tokens, 20 poison: every effect once, every poison
    message dead-lettered once, with 50 messages in flight on one event loop."""
    if store == "sqlite":
        app, table = test_app(tmp_path), "effects"
        with app.store.transaction() as tx:
            tx.execute(text("create table effects (token text not null, attempt integer)"))
        count = lambda: sqlite_counts(app, table)  # noqa: E731
    else:
        url = request.getfixturevalue("postgres_url")
        table = request.getfixturevalue("pg_effects")
        app = test_app(tmp_path, store=url, cache=request.getfixturevalue("redis_url"))
        count = lambda: effect_counts(url, table)  # noqa: E731
    unique_tokens = [f"t{i}" for i in range(9_091)]
    poison = set(random.Random(3).sample(unique_tokens, 20))
    rng = random.Random(7)
    bodies = unique_tokens + rng.sample(unique_tokens, 10_000 - len(unique_tokens))
    rng.shuffle(bodies)
    loops: set[int] = set()

    @app.handler("orders", group=unique, token="body.token", concurrency=50, prefetch=500,
                 fatal=[ValueError])
    async def handle(msg: Message, tx) -> None:
        loops.add(id(asyncio.get_running_loop()))
        await asyncio.sleep(0)  # let the other messages in flight run
        if msg.body["token"] in poison:
            raise ValueError(f"poison {msg.body['token']}")
        await insert(tx, table, msg.body["token"])

    app.publish_many("orders", [{"token": t} for t in bodies])
    app.run(until_idle=True)

    assert count() == {t: 1 for t in unique_tokens if t not in poison}
    letters = app.dead_letters(unique, limit=1000)
    assert sorted(letter.token or "" for letter in letters) == sorted(poison)
    assert all(letter.failure.error_type == "builtins.ValueError" for letter in letters)
    stats = app.stats()
    assert stats["processed"] == len(unique_tokens) - len(poison)
    assert stats["dead_lettered"] == len(poison)
    assert stats["processed"] + stats["duplicate"] + stats["dead_lettered"] == 10_000
    assert len(loops) == 1  # one event loop
    assert pending(app, unique, "orders") == 0
    app.close()


def test_fifty_messages_are_really_in_flight_at_once(tmp_path, postgres_url, pg_effects, unique) -> None:
    """No handler returns until fifty are inside it at the same time, on one thread."""
    app = test_app(tmp_path, store=postgres_url)
    inside: set[str] = set()
    threads: set[str] = set()
    all_in = asyncio.Event()
    peak = 0

    @app.handler("orders", group=unique, token="body.token", concurrency=50, prefetch=50)
    async def handle(msg: Message, tx) -> None:
        nonlocal peak
        threads.add(threading.current_thread().name)
        await insert(tx, pg_effects, msg.body["token"])
        inside.add(msg.body["token"])
        peak = max(peak, len(inside))
        if len(inside) == 50:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 60)

    app.publish_many("orders", [{"token": f"t{i}"} for i in range(50)])
    app.run(until_idle=True)

    assert peak == 50 and len(threads) == 1
    assert effect_counts(postgres_url, pg_effects) == {f"t{i}": 1 for i in range(50)}
    app.close()


def test_one_key_keeps_its_order_while_others_interleave(app: App) -> None:
    seen: dict[str, list[int]] = {}
    rng = random.Random(5)

    @app.handler("orders", token="body.n", concurrency=8, prefetch=200)
    async def handle(msg: Message) -> None:
        await asyncio.sleep(rng.random() / 1000)
        seen.setdefault(msg.key or "", []).append(msg.body["n"])

    for n in range(200):
        app.publish("orders", {"n": n}, key=f"k{n % 5}")
    app.run(until_idle=True)

    assert {k: v == sorted(v) for k, v in seen.items()} == {f"k{i}": True for i in range(5)}
    assert sum(len(v) for v in seen.values()) == 200


def test_retry_in_process_then_redelivery_then_success(app: App) -> None:
    attempts: list[int] = []

    @app.handler("jobs", token="body.id", in_process=2,
                 retry=reliable.RedeliveryPolicy(initial_delay=1, multiplier=2, max_redeliveries=5))
    async def job(msg: Message, tx) -> None:
        attempts.append(msg.attempt)
        if len(attempts) < 4:
            raise Transient("not yet")
        await insert(tx, "effects", msg.body["id"], msg.attempt)

    app.publish("jobs", {"id": "j1"})
    app.run(until_idle=True)

    assert attempts == [1, 1, 2, 2]  # two in process per delivery, redelivered once
    assert sqlite_counts(app, "effects") == {"j1": 1}
    stats = app.stats()
    assert stats["retried"] == 2 and stats["redelivered"] == 1 and stats["processed"] == 1
    assert app.dead_letters("job") == []


def test_a_failing_async_handler_rolls_back_its_writes_and_is_dead_lettered(app: App) -> None:
    @app.handler("jobs", token="body.id", fatal=[KeyError])
    async def job(msg: Message, tx) -> None:
        await insert(tx, "effects", msg.body["id"])
        raise KeyError("missing")

    app.publish("jobs", {"id": "j1"})
    app.run(until_idle=True)

    assert sqlite_counts(app, "effects") == {}  # the awaited write rolled back with the claim
    [letter] = app.dead_letters("job")
    assert letter.failure.error_type == "builtins.KeyError" and letter.failure.attempts == 1
    assert len(dead_letter_queue(app, "job")) == 1
    assert app.stats()["processed"] == 0


def test_batch_mode_isolates_a_poison_message(app: App) -> None:
    batches: list[int] = []

    @app.handler("jobs", token="body.id", batch=10, fatal=[ValueError])
    async def jobs(messages: list[Message], tx) -> None:
        batches.append(len(messages))
        for m in messages:
            if m.body["id"] == "bad":
                raise ValueError("bad")
            await insert(tx, "effects", m.body["id"])

    app.publish_many("jobs", [{"id": f"j{i}"} for i in range(9)] + [{"id": "bad"}])
    app.run(until_idle=True)

    assert sqlite_counts(app, "effects") == {f"j{i}": 1 for i in range(9)}
    assert [letter.token for letter in app.dead_letters("jobs")] == ["bad"]
    assert batches[0] == 10  # together first, then one by one in savepoints


def test_lease_mode_returns_the_stored_result_to_duplicates(app: App) -> None:
    calls: list[str] = []

    @app.handler("mail", token="body.id", lease=30)
    async def send(msg: Message) -> dict[str, str]:
        calls.append(msg.body["id"])
        await asyncio.sleep(0)
        return {"sent": msg.body["id"]}

    app.publish_many("mail", [{"id": "m1"}, {"id": "m1"}, {"id": "m2"}])
    app.run(until_idle=True)

    assert sorted(calls) == ["m1", "m2"]
    stats = app.stats()
    assert stats["processed"] == 2 and stats["duplicate"] == 1


@pytest.mark.parametrize("commit", STRATEGIES)
def test_every_commit_strategy_acks_each_message_once(app: App, commit: str) -> None:
    @app.handler("orders", token="body.id", commit=commit, concurrency=4, prefetch=20)
    async def handle(msg: Message, tx) -> None:
        await insert(tx, "effects", msg.body["id"])

    app.publish_many("orders", [{"id": f"o{i % 30}"} for i in range(40)])
    app.run(until_idle=True)

    assert sqlite_counts(app, "effects") == {f"o{i}": 1 for i in range(30)}
    assert pending(app, "handle", "orders") == 0


def test_async_twins_meet_at_the_unique_index(tmp_path, postgres_url, pg_effects, unique) -> None:
    """Three copies of one token in flight on one loop (three keys, three lanes): the first
    holds its claim until PostgreSQL shows a twin waiting on a lock (pg_locks); then one
    effect and two duplicates."""
    from tests.framework.test_races import PATIENCE, WAITING

    saw_wait, release = threading.Event(), threading.Event()
    app = test_app(tmp_path, store=postgres_url)

    @app.handler("work", group=unique, token="body.token", concurrency=3, prefetch=3)
    async def handle(msg: Message, tx) -> None:
        await insert(tx, pg_effects, msg.body["token"])
        await asyncio.to_thread(release.wait, PATIENCE)  # hold the claim; the loop runs on

    def watch() -> None:
        engine = create_engine(postgres_url)
        with engine.connect() as connection:
            for _ in range(PATIENCE * 100):
                if connection.execute(text(WAITING)).scalar():
                    saw_wait.set()
                    break
                connection.rollback()  # pg_stat_activity is read once per transaction
                release.wait(0.01)
        release.set()
        engine.dispose()

    for key in ("a", "b", "g"):  # crc32 puts these three keys in three different lanes
        app.publish("work", {"token": "twin"}, key=key)
    watcher = threading.Thread(target=watch)
    watcher.start()
    app.run(until_idle=True)
    watcher.join()

    assert saw_wait.is_set(), "no twin was seen waiting on the unique index"
    assert effect_counts(postgres_url, pg_effects) == {"twin": 1}
    stats = app.stats()
    assert (stats["processed"], stats["duplicate"]) == (1, 2)
    app.close()
