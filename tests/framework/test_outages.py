"""Backend outages: a cache that is down degrades to the store; a store that is down means no ack."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest
from sqlalchemy import text

from reliable import Message
from reliable.testing import FakeClock, test_app
from tests.tcp_proxy import TcpProxy

from .conftest import create_effects, cut_once_the_store_answers, effects, write_effect


def test_cache_outage_degrades_to_the_store(tmp_path) -> None:
    with socket_closed_port() as port:
        app = test_app(tmp_path, cache=f"redis://127.0.0.1:{port}/0")
    create_effects(app, "effects")

    @app.handler("orders", token="body.id")
    def handle(msg: Message, tx) -> None:
        write_effect(tx, msg.body["id"])

    app.publish_many("orders", [{"id": i} for i in ["a", "b", "a", "c", "a"]])
    app.run(until_idle=True)

    assert effects(app) == ["a", "b", "c"]  # nothing processed twice without the cache
    stats = app.stats()
    assert stats["processed"] == 3 and stats["duplicate"] == 2
    assert stats["cache_degraded"] >= 1  # one lookup per fetch (and per fill), each degraded
    app.close()


class RestoringClock(FakeClock):
    """A fake clock that brings the store back after ``outage_sleeps`` waits of the worker."""

    def __init__(self, proxy: TcpProxy, outage_sleeps: int) -> None:
        super().__init__()
        self.proxy, self.outage_sleeps = proxy, outage_sleeps

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if len(self.sleeps) == self.outage_sleeps:
            self.proxy.restore()


def test_store_outage_acks_nothing_and_loses_nothing(tmp_path, postgres_url, unique) -> None:
    parts = urlsplit(postgres_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{proxy.port}"))
    clock = RestoringClock(proxy, outage_sleeps=3)
    app = test_app(tmp_path, clock=clock, store=proxied, settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    table = f"{unique}_effects"
    create_effects(app, table)
    calls: list[str] = []

    @app.handler("orders", group=unique, token="body.id")
    def handle(msg: Message, tx) -> None:
        calls.append(msg.body["id"])
        write_effect(tx, msg.body["id"], msg.attempt, table=table)

    app.publish_many("orders", [{"id": f"o{i}"} for i in range(5)])
    cut_once_the_store_answers(app, proxy)
    app.run(until_idle=True)  # defers while the store is down, then processes when it is back

    assert effects(app, table) == [f"o{i}" for i in range(5)]
    assert sorted(calls) == [f"o{i}" for i in range(5)]  # the handler never ran during the outage
    stats = app.stats()
    assert stats["deferred"] >= 5 and stats["processed"] == 5
    assert app.dead_letters(unique) == []
    with app.store.transaction() as tx:
        tx.execute(text(f"drop table {table}"))
    app.close()
    proxy.close()


class socket_closed_port:
    """A local port with nothing listening (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture(autouse=True)
def _no_env_settings(monkeypatch) -> None:
    monkeypatch.delenv("RELIABLE_SETTINGS", raising=False)
