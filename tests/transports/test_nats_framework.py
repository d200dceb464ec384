"""The framework on `nats://`: handlers with the transactional commit strategy, and kill -9 chaos.

Real NATS JetStream, real PostgreSQL store and Redis cache. Every test runs in
a namespace of its own (``?namespace=``) whose streams are deleted afterwards.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text

from backends.transport.nats_transport import NatsTransport
from backends.types import OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings
from tests.tcp_proxy import TcpProxy
from tests.transports.chaos import kill_9_chaos
from tests.transports.test_kafka_framework import (
    Flaky,
    Poison,
    dead_letter_counts,
    effect_counts,
    effects,  # noqa: F401  (a fixture)
    wait_until,
)
from tests.transports.test_nats import read_dead_letters

ROOT = Path(__file__).resolve().parents[2]
ACK_WAIT = 3.0
"""AckWait of these tests: how long a killed worker's messages stay with it."""
WAIT_CUT = 30.0


@pytest.fixture
def place(nats_url: str, unique: str) -> Iterator[str]:
    """A namespace of its own on the real server, its streams deleted afterwards."""
    url = f"{nats_url}?namespace={unique}"
    yield url
    with NatsTransport(nats_url, namespace=unique) as transport:
        transport.purge()


def settings_env(url: str, postgres_url: str, redis_url: str) -> dict[str, str]:
    return {
        "RELIABLE_TRANSPORT__URL": url,
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(ACK_WAIT),
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": redis_url,
        "RELIABLE_COMMIT__STRATEGY": "transactional",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }


def test_a_handler_on_nats_with_transactional_commits(
    place: str, nats_url: str, postgres_url: str, redis_url: str, effects: str, unique: str  # noqa: F811
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
    assert (failed_once[0].attempt, retried[0].attempt) == (1, 2)  # JetStream's delivery count
    with NatsTransport(nats_url, namespace=unique) as transport:
        subscription = transport.subscribe(unique, [unique])
        assert subscription.pending() == 0  # every message acked or terminated
        subscription.close()
    ((payload, headers),) = read_dead_letters(nats_url, unique, unique, 1)
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
    place: str, nats_url: str, postgres_url: str, redis_url: str, effects: str, unique: str  # noqa: F811
) -> None:
    parts = urlsplit(nats_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 4222)
    through_proxy = f"nats://127.0.0.1:{proxy.port}?namespace={unique}"
    app = App(Settings.load(None, env=settings_env(through_proxy, postgres_url, redis_url)))
    entered, cut = threading.Event(), threading.Event()

    @app.handler(unique, group=unique, token="body.token")
    def handle(message: Message, tx) -> None:
        if message.body["token"] == "t50" and not cut.is_set():
            entered.set()
            assert cut.wait(WAIT_CUT), "the connection was never cut"
        tx.execute(text(f"insert into {effects} (token) values (:t)"), {"t": message.body["token"]})

    tokens = [f"t{n}" for n in range(200)]
    with NatsTransport(nats_url, namespace=unique) as producer:
        producer.publish(unique, [OutgoingMessage(json.dumps({"token": t}).encode()) for t in tokens])
    runner = threading.Thread(target=app.run)
    runner.start()
    transport = app.runtime.transport
    assert isinstance(transport, NatsTransport)
    try:
        assert entered.wait(WAIT_CUT)  # t50 is in flight
        proxy.cut()
        cut.set()  # its handler commits; its ack meets a dead connection
        wait_until(lambda: not transport.connected, runner.is_alive, 0.05)
        proxy.restore()
        with NatsTransport(nats_url, namespace=unique) as check:
            watcher = check.subscribe(unique, [unique])  # never fetches: reads the consumers' counts
            # every token's effect, and every message acked: held work came back after AckWait, a duplicate
            wait_until(lambda: len(effect_counts(postgres_url, effects)) == len(tokens)
                       and watcher.pending() == 0, runner.is_alive)
            watcher.close()
    finally:
        app.stop()
        runner.join()
        proxy.close()
    assert effect_counts(postgres_url, effects) == {t: 1 for t in tokens}
    assert transport.reconnects >= 1
    app.close()
