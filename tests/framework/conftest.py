from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy import event, text

from backends.store.sqlalchemy import SqlStore
from reliable import App
from reliable.testing import FakeClock, test_app
from tests.tcp_proxy import TcpProxy


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh SQLite store, then of the test PostgreSQL database: a test runs on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def app(tmp_path, clock) -> Iterator[App]:
    app = test_app(tmp_path, clock=clock)
    create_effects(app, "effects")
    yield app
    app.close()


def create_effects(app: App, table: str) -> None:
    """A table the handlers write their side effects to (one row per effect)."""
    with app.store.transaction() as tx:
        tx.execute(text(f"create table if not exists {table} (token text, attempt integer)"))


def effects(app: App, table: str = "effects") -> list[str]:
    with app.store.transaction() as tx:
        return [row[0] for row in tx.execute(text(f"select token from {table} order by token"))]


def write_effect(tx, token: str, attempt: int = 1, table: str = "effects") -> None:
    tx.execute(text(f"insert into {table} (token, attempt) values (:t, :a)"), {"t": token, "a": attempt})


def pending(app: App, group: str, topic: str) -> int:
    """What the transport still holds for ``group`` on ``topic`` (a member that only looks)."""
    with app.transport.subscribe(group, [topic]) as subscription:
        return subscription.pending()


@pytest.fixture
def postgres_proxy(postgres_url: str) -> Iterator[TcpProxy]:
    """A `TcpProxy` in front of PostgreSQL: connect through ``postgres_proxy.port`` to cut and
    restore the store's connections."""
    parts = urlsplit(postgres_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    yield proxy
    proxy.close()


def cut_once_the_store_answers(app: App, proxy: TcpProxy) -> None:
    """Cut ``proxy`` (the store's) right after the worker's first write probe committed: a worker
    fetches nothing until its store takes a write (`reliable.deferrals.StoreGate`), so an outage
    that meets messages in hand begins once the worker has found the store up."""
    assert isinstance(app.store, SqlStore)
    probes: list[str] = []  # "written", then "cut"

    def executed(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if not probes and statement.lstrip().upper().startswith("INSERT INTO RELIABLE_WRITE_PROBE"):
            probes.append("written")

    def returned(*_: Any) -> None:  # the probe's connection back in the pool: its unit committed
        if probes == ["written"]:
            probes.append("cut")
            proxy.cut()

    event.listen(app.store.engine, "after_cursor_execute", executed)
    event.listen(app.store.engine, "checkin", returned)
