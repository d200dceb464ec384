"""The Redis cache cut, hung and recovered mid-run (real Redis behind `tests.tcp_proxy`).

A second round of tokens is consumed while the cache breaks under the
worker: cut (connections dropped, new ones refused) or hung (sockets open,
nothing answered, so every call must end in the cache's socket timeout).
Half the round are tokens the cache already holds. In single, batch and
lease mode the worker goes on against the store alone and, once the cache is
back, fills it again: every token's side effect is in PostgreSQL exactly
once, and the cache holds every token at the end.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import structlog
from sqlalchemy import Engine, create_engine, event, text

from backends.store.sqlalchemy import SqlStore
from reliable import App, Message
from reliable.testing import test_app
from tests.tcp_proxy import TcpProxy

MODES: dict[str, dict[str, Any]] = {
    "single": {"prefetch": 8},
    "batch": {"batch": 5},
    "lease": {"lease": 30.0, "prefetch": 8},
}
FIRST = [f"a{i}" for i in range(30)]
SECOND = [f"b{i}" for i in range(30)]
BREAK_AT = 10  # the handler breaks the cache at its 10th call of the second round
FETCHES_DOWN = 3  # a cut lasts this many failed cache calls (each fails at once)


@pytest.fixture
def engine(postgres_url: str, unique: str) -> Iterator[Engine]:
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null)"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}"))
    engine.dispose()


@pytest.fixture
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    parts = urlsplit(redis_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
    yield proxy
    proxy.close()


def counts(engine: Engine, table: str) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text(f"select token, count(*) from {table} group by token")).all())


class Fault:
    """Breaks the cache from inside the handler at one call, and brings it back after it failed."""

    def __init__(self, app: App, proxy: TcpProxy, kind: str) -> None:
        self.app, self.proxy, self.kind = app, proxy, kind
        self.calls = 0
        self.broken_at: int | None = None
        self.restored_at: int | None = None
        self.claimed_while_down: set[str] = set()  # tokens the store was asked about, cache broken
        event.listen(store_engine(app), "after_cursor_execute", self._claimed)
        # a hang costs one socket timeout per call: one failed call is enough to prove it
        self.down_for = 1 if kind == "hang" else FETCHES_DOWN

    def step(self) -> None:
        self.calls += 1
        degraded = self.app.stats().get("cache_degraded", 0)
        if self.calls == BREAK_AT:
            self.broken_at = degraded
            self.proxy.cut() if self.kind == "cut" else self.proxy.hang()
        elif self.broken_at is not None and self.restored_at is None and degraded >= self.broken_at + self.down_for:
            self.restored_at = self.calls
            self.proxy.restore()

    def _claimed(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        down = self.broken_at is not None and self.restored_at is None
        if down and "INSERT INTO reliable_tokens" in statement:
            self.claimed_while_down.update(words(parameters))


def words(parameters: Any) -> set[str]:
    """Every word in a statement's parameters, however the store sends its tokens (one, a list,
    lines of text)."""
    values = list(parameters.values()) if isinstance(parameters, dict) else list(parameters or [])
    found: set[str] = set()
    for value in values:
        if isinstance(value, str):
            found.update(re.findall(r"\w+", value))
        elif isinstance(value, list | tuple | dict):
            found |= words(value)
    return found


def register(app: App, mode: str, group: str, engine: Engine, fault: Fault | None) -> None:
    def effect(tx: Any, token: str) -> None:
        if fault is not None:
            fault.step()
        if tx is None:  # lease mode: a side effect outside the store's transaction
            with engine.begin() as conn:
                conn.execute(text(f"insert into {group} (token) values (:t)"), {"t": token})
        else:
            tx.execute(text(f"insert into {group} (token) values (:t)"), {"t": token})

    if mode == "batch":
        @app.handler("orders", group=group, token="body.id", **MODES[mode])
        def handle_batch(msgs: list[Message], tx) -> None:
            for m in msgs:
                effect(tx, m.body["id"])
    elif mode == "lease":
        @app.handler("orders", group=group, token="body.id", **MODES[mode])
        def handle_leased(msg: Message) -> str:
            effect(None, msg.body["id"])
            return "done"
    else:
        @app.handler("orders", group=group, token="body.id", **MODES[mode])
        def handle(msg: Message, tx) -> None:
            effect(tx, msg.body["id"])


@pytest.mark.parametrize("kind", ["cut", "hang"])
@pytest.mark.parametrize("mode", list(MODES))
def test_cache_broken_mid_run_loses_nothing_and_doubles_nothing(
    tmp_path, postgres_url: str, engine: Engine, proxy: TcpProxy, unique: str, mode: str, kind: str
) -> None:
    cache_url = f"redis://127.0.0.1:{proxy.port}/0"
    warm = test_app(tmp_path / "first", store=postgres_url, cache=cache_url)
    register(warm, mode, unique, engine, None)
    warm.publish_many("orders", [{"id": t} for t in FIRST])
    warm.run(until_idle=True)  # the first round is done and in the cache
    assert warm.runtime.cache is not None and warm.runtime.cache.seen(unique, FIRST) == set(FIRST)
    warm.close()

    app = test_app(tmp_path / "second", store=postgres_url, cache=cache_url)
    fault = Fault(app, proxy, kind)
    register(app, mode, unique, engine, fault)
    second = [*SECOND, *SECOND[:15], *FIRST]  # new tokens, their copies, and the first round again
    random.Random(16).shuffle(second)
    app.publish_many("orders", [{"id": t} for t in second])
    with structlog.testing.capture_logs() as logs:
        app.run(until_idle=True)

    assert fault.broken_at is not None and fault.restored_at is not None, "the cache broke and came back mid-run"
    failures = [e["error"] for e in logs if e["event"] == "cache_degraded"]
    assert len(failures) >= fault.down_for
    if kind == "hang":  # the request went into the black hole and the client gave up on its own
        assert proxy.chunks_swallowed >= 1 and any("Timeout" in error for error in failures), failures
    # copies of tokens the cache holds arrived while it was broken: the store's claim caught them
    assert fault.claimed_while_down & set(FIRST), fault.claimed_while_down
    assert counts(engine, unique) == dict.fromkeys(FIRST + SECOND, 1)  # nothing lost, nothing doubled
    stats = app.stats()
    assert stats["processed"] == len(SECOND) and stats["duplicate"] == len(second) - len(SECOND)
    assert app.dead_letters(unique) == []
    assert app.runtime.cache is not None
    assert app.runtime.cache.seen(unique, FIRST + SECOND) == set(FIRST + SECOND)  # filled again once back
    app.close()


def store_engine(app: App) -> Engine:
    """The SQLAlchemy engine under the app's PostgreSQL store (the test listens to its events)."""
    assert isinstance(app.store, SqlStore)
    return app.store.engine
