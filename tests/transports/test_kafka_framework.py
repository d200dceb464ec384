"""The framework on `kafka://`: handlers with the transactional commit strategy, and kill -9 chaos.

Real PostgreSQL store; Kafka is librdkafka's mock cluster in a process of its
own (`MockCluster`), so consumer processes can be SIGKILLed while it lives.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from sqlalchemy import create_engine, text

from reliable import App, Message
from reliable.settings import Settings
from tests.transports.chaos import kill_9_chaos
from tests.transports.test_kafka import read_topic
from tests.transports.test_kafka_suite import SESSION_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
WAIT = 300.0  # the bound on every wait for the database to show the expected effects


@pytest.fixture(scope="module")
def cluster() -> Iterator:
    from backends.transport.kafka_mock import MockCluster

    with MockCluster(brokers=3) as started:
        yield started


@pytest.fixture
def effects(postgres_url: str, unique: str) -> Iterator[str]:
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null)"))
    yield unique
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}"))
    engine.dispose()


def settings_env(cluster_url: str, postgres_url: str) -> dict[str, str]:
    return {
        "RELIABLE_TRANSPORT__URL": cluster_url,
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT),
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_COMMIT__STRATEGY": "transactional",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }


def effect_counts(postgres_url: str, table: str) -> dict[str, int]:
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        rows = conn.execute(text(f"select token, count(*) from {table} group by token")).all()
    engine.dispose()
    return {token: n for token, n in rows}


def dead_letter_counts(postgres_url: str, group: str, by: str = "token") -> dict[str, int]:
    """Dead-letter records of ``group`` per token (or per ``message_id``)."""
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(f'select {by}, count(*) from reliable_dead_letters where "group" = :g group by {by}'), {"g": group}
        ).all()
    engine.dispose()
    return {token: n for token, n in rows}


def committed_offsets(url: str, group: str, topic: str) -> dict[int, int]:
    """The offsets ``group`` committed in Kafka for the partitions of ``topic``."""
    consumer = Consumer({"bootstrap.servers": url.removeprefix("kafka://"), "group.id": group})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in found if tp.offset >= 0}


def wait_until(condition: Callable[[], bool], alive: Callable[[], bool] = lambda: True, every: float = 0.2) -> None:
    """Poll ``condition`` (a database query) every ``every`` seconds until it holds; bounded by `WAIT`."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert alive(), "the consumer stopped"
        assert time.monotonic() < deadline, "the expected effects never showed"
        time.sleep(every)


class Flaky(Exception):
    """A failure worth another try."""


class Poison(Exception):
    """A failure no retry helps."""


def test_a_handler_on_kafka_with_transactional_commits(cluster, postgres_url: str, effects: str, unique: str) -> None:
    app = App(Settings.load(None, env=settings_env(cluster.url, postgres_url)))
    failed_once: list[Message] = []

    @app.handler(unique, group=unique, token="body.token", fatal=[Poison], retry_on=[Flaky])
    def handle(message: Message, tx) -> None:
        if message.body["token"] == "poison":
            raise Poison("never")
        if message.body["token"] == "flaky" and not failed_once:
            failed_once.append(message)
            raise Flaky("once")
        tx.execute(text(f"insert into {effects} (token) values (:t)"), {"t": message.body["token"]})

    tokens = [f"t{n}" for n in range(100)]
    app.publish_many(unique, [{"token": t} for t in tokens * 2 + ["flaky", "poison"]])
    runner = threading.Thread(target=app.run)
    runner.start()
    try:
        wait_until(lambda: len(effect_counts(postgres_url, effects)) == 101
                   and dead_letter_counts(postgres_url, unique) == {"poison": 1}, runner.is_alive)
    finally:
        app.stop()
        runner.join()
    assert effect_counts(postgres_url, effects) == {t: 1 for t in [*tokens, "flaky"]}
    assert failed_once[0].attempt == 1
    assert sum(committed_offsets(cluster.url, unique, unique).values()) == 202  # every message done
    saved = app.runtime.store.load_offsets(unique)
    assert any(ref.topic == unique for ref in saved)  # saved in the handler's transactions
    assert any(ref.topic.startswith(f"{unique}-retry-{unique}-") for ref in saved)  # the retry came back
    ((payload, headers),) = read_topic(cluster, f"{unique}-dlt-{unique}", 1)
    assert b"poison" in payload and headers["x-reliable-error-message"] == "never"
    app.close()


@pytest.mark.parametrize(
    ("kills", "count"), [(20, 10_000), pytest.param(100, 50_000, marks=pytest.mark.soak)]
)
def test_kill_9_at_random_points_each_token_once_each_poison_dead_lettered_once(
    cluster, postgres_url: str, effects: str, unique: str, kills: int, count: int
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    kill_9_chaos({**env, **settings_env(cluster.url, postgres_url)}, postgres_url, effects, unique, kills, count)
