"""The framework on `amqp://`: handlers with the transactional commit strategy, kill -9 chaos, a cut.

Real RabbitMQ (quorum queues), real PostgreSQL store and Redis cache. Every
test runs in a namespace of its own (``?namespace=``) whose queues and
exchanges are deleted afterwards.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from sqlalchemy import text

from backends.transport.amqp_transport import AmqpTransport
from backends.types import OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings
from tests.tcp_proxy import TcpProxy
from tests.transports.chaos import kill_9_chaos
from tests.transports.test_amqp import read_dead_letters
from tests.transports.test_kafka_framework import (
    Flaky,
    Poison,
    dead_letter_counts,
    effect_counts,
    effects,  # noqa: F401  (a fixture)
    wait_until,
)

HEARTBEAT = 3.0
"""The tests' visibility_timeout: the AMQP heartbeat of their connections."""
WAIT_CUT = 30.0


@pytest.fixture
def place(amqp_url: str, unique: str) -> Iterator[str]:
    """A namespace of its own on the real server, its queues deleted afterwards."""
    yield f"{amqp_url}?namespace={unique}"
    with AmqpTransport(amqp_url, namespace=unique) as transport:
        transport.declare(unique, [unique])  # so that purge knows the group's queues
        transport.purge()


def settings_env(url: str, postgres_url: str, redis_url: str) -> dict[str, str]:
    return {
        "RELIABLE_TRANSPORT__URL": url,
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(HEARTBEAT),
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": redis_url,
        "RELIABLE_COMMIT__STRATEGY": "transactional",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }


def test_a_handler_on_rabbitmq_with_transactional_commits(
    place: str, amqp_url: str, postgres_url: str, redis_url: str, effects: str, unique: str  # noqa: F811
) -> None:
    app = App(Settings.load(None, env=settings_env(place, postgres_url, redis_url)))
    failed_once: list[Message] = []
    retried: list[Message] = []

    @app.handler(unique, group=unique, token="body.token", fatal=[Poison], retry_on=[Flaky])
    def handle(message: Message, tx) -> None:
        if message.body["token"] == "poison":
            raise Poison("never")
        if message.body["token"] == "flaky":
            if not failed_once:
                failed_once.append(message)
                raise Flaky("once")
            retried.append(message)
        tx.execute(text(f"insert into {effects} (token) values (:t)"), {"t": message.body["token"]})

    tokens = [f"t{n}" for n in range(100)]
    # published before any worker runs: the app declares its handler's group first
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
    assert (failed_once[0].attempt, retried[0].attempt) == (1, 2)  # counted through the delay queue
    with AmqpTransport(amqp_url, namespace=unique) as transport:
        subscription = transport.subscribe(unique, [unique])
        assert subscription.pending() == 0  # every message acked, none waiting in a delay queue
        subscription.close()
    ((payload, headers),) = read_dead_letters(amqp_url, unique, unique)
    assert b"poison" in payload and headers["x-reliable-error-message"] == "never"
    app.close()


@pytest.mark.parametrize(
    ("kills", "count"), [(20, 10_000), pytest.param(100, 50_000, marks=pytest.mark.soak)]
)
def test_kill_9_at_random_points_each_token_once_each_poison_dead_lettered_once(
    place: str, postgres_url: str, redis_url: str, effects: str, unique: str, kills: int, count: int  # noqa: F811
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    kill_9_chaos({**env, **settings_env(place, postgres_url, redis_url)}, postgres_url, effects, unique, kills, count)


def test_a_cut_connection_reconnects_and_loses_nothing(
    place: str, amqp_url: str, postgres_url: str, redis_url: str, effects: str, unique: str  # noqa: F811
) -> None:
    parts = urlsplit(amqp_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    netloc = f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"
    through_proxy = urlunsplit((parts.scheme, netloc, parts.path, f"namespace={unique}", ""))
    app = App(Settings.load(None, env=settings_env(through_proxy, postgres_url, redis_url)))
    entered, cut = threading.Event(), threading.Event()

    @app.handler(unique, group=unique, token="body.token")
    def handle(message: Message, tx) -> None:
        if message.body["token"] == "t50" and not cut.is_set():
            entered.set()
            assert cut.wait(WAIT_CUT), "the connection was never cut"
        tx.execute(text(f"insert into {effects} (token) values (:t)"), {"t": message.body["token"]})

    tokens = [f"t{n}" for n in range(200)]
    with AmqpTransport(amqp_url, namespace=unique) as producer:
        producer.declare(unique, [unique])
        producer.publish(unique, [OutgoingMessage(json.dumps({"token": t}).encode()) for t in tokens])
    runner = threading.Thread(target=app.run)
    runner.start()
    try:
        assert entered.wait(WAIT_CUT)  # t50 is in flight
        proxy.cut()  # every connection through the proxy dropped, new ones refused
        cut.set()  # t50's handler commits; its ack meets a dead connection
        wait_until(lambda: app.stats()["processed"] >= 51, runner.is_alive, 0.05)
        proxy.restore()
        # t50 (and what the member held) came back from RabbitMQ; t50 is now a duplicate
        wait_until(lambda: len(effect_counts(postgres_url, effects)) == len(tokens)
                   and app.stats()["duplicate"] >= 1, runner.is_alive)
    finally:
        app.stop()
        runner.join()
        proxy.close()
    assert effect_counts(postgres_url, effects) == {t: 1 for t in tokens}
    assert app.stats()["duplicate"] >= 1  # the cut really cost an ack: t50 was redelivered
    app.close()
