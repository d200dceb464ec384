"""PostgreSQL cut at the worst moments (real server behind `tests.tcp_proxy`), in every mode.

A trap on the store's engine (SQLAlchemy events) springs on one token's
transaction, so the fault lands exactly where it is meant to:

* ``mid_transaction``: the connection is cut right after the handler's insert
  of the token ran, while its transaction is open (lease mode: right after
  the lease's insert, before its commit);
* ``commit_lost``: the connection is cut as COMMIT is about to be sent: the
  server never sees it and rolls the transaction back;
* ``reply_lost``: COMMIT reaches the server, which commits, and its answer is
  dropped with every connection: the client sees a failed commit that in fact
  succeeded (lease mode: the lease's commit, and the commit of its result).

Each test asserts that its situation really happened (the trap sprang, the
failure the client saw, the reconnects) and that every token's side effect
is in PostgreSQL exactly once. Lease mode's cut of the result's commit after
an outside side effect is at-least-once by design and is covered in
`test_pipeline_outages.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import structlog
from sqlalchemy import Engine, create_engine, event, text

from backends.store.sqlalchemy import SqlStore
from reliable import App, Message
from reliable.testing import FakeClock, test_app
from tests.tcp_proxy import TcpProxy

TOKENS = [f"o{i}" for i in range(12)]
TARGET = "o5"  # in batches of 4: the second message of the second batch
Match = Callable[[str, Any], bool]


class RestoringClock(FakeClock):
    """A fake clock that brings the store back whenever the worker waits."""

    def __init__(self, postgres_proxy: TcpProxy) -> None:
        super().__init__()
        self.postgres_proxy = postgres_proxy

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.postgres_proxy.restore()


class Trap:
    """Springs once on the transaction in which a statement ``match`` accepts ran."""

    def __init__(self, engine: Engine, postgres_proxy: TcpProxy, match: Match, moment: str) -> None:
        self.postgres_proxy, self.match, self.moment = postgres_proxy, match, moment
        self.sprung = 0
        self.connects_after = 0  # new connections opened after the trap sprang: the reconnects
        self.errors: list[tuple[str | None, bool]] = []  # (statement, is_disconnect) the client saw
        self._marked: set[int] = set()
        event.listen(engine, "after_cursor_execute", self._executed)
        event.listen(engine, "commit", self._committing)
        event.listen(engine, "rollback", lambda conn: self._marked.discard(id(conn)))
        event.listen(engine, "handle_error", self._failed)
        event.listen(engine, "connect", self._connected)

    def _executed(self, conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if self.sprung or not isinstance(parameters, dict | list | tuple) or not self.match(statement, parameters):
            return
        if self.moment == "mid_transaction":
            self._spring(self.postgres_proxy.cut)
        else:
            self._marked.add(id(conn))

    def _committing(self, conn: Any) -> None:  # runs before the driver sends COMMIT
        if id(conn) not in self._marked:
            return
        self._marked.discard(id(conn))
        self._spring(self.postgres_proxy.cut if self.moment == "commit_lost" else self.postgres_proxy.lose_next_reply)

    def _spring(self, fault: Callable[[], None]) -> None:
        self.sprung += 1
        fault()

    def _failed(self, context: Any) -> None:
        if self.sprung:
            self.errors.append((context.statement, context.is_disconnect))

    def _connected(self, *_: Any) -> None:
        if self.sprung:
            self.connects_after += 1


@pytest.fixture
def direct(postgres_url: str, unique: str) -> Iterator[Engine]:
    """The test's own connection to PostgreSQL (not through the postgres_proxy), and the effects table."""
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null)"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}"))
    engine.dispose()


def effects(engine: Engine, table: str) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text(f"select token, count(*) from {table} group by token")).all())


def start(tmp_path, postgres_url: str, postgres_proxy: TcpProxy) -> App:
    parts = urlsplit(postgres_url)
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{postgres_proxy.port}"))
    app = test_app(tmp_path, clock=RestoringClock(postgres_proxy), store=proxied, cache="none")
    app.store.count_dead_letters("none")  # the tables exist before any trap is set
    return app


def store_engine(app: App) -> Engine:
    """The SQLAlchemy engine under the app's PostgreSQL store (the traps listen to its events)."""
    assert isinstance(app.store, SqlStore)
    return app.store.engine


def insert_effect(table: str) -> Callable[[Any, str], None]:
    """The handler's side effect in its transaction, then one more statement in it."""
    def write(tx: Any, token: str) -> None:
        tx.execute(text(f"insert into {table} (token) values (:t)"), {"t": token})
        tx.execute(text(f"select count(*) from {table} where token = :t"), {"t": token})

    return write


@pytest.mark.parametrize("moment", ["mid_transaction", "commit_lost", "reply_lost"])
@pytest.mark.parametrize("mode", ["single", "batch"])
def test_store_cut_in_the_handlers_transaction(
    tmp_path, postgres_url: str, postgres_proxy: TcpProxy, direct: Engine, unique: str, mode: str, moment: str
) -> None:
    app = start(tmp_path, postgres_url, postgres_proxy)
    calls: Counter[str] = Counter()
    write = insert_effect(unique)
    trap = Trap(store_engine(app), postgres_proxy, moment=moment,
                match=lambda sql, p: sql.startswith(f"insert into {unique}") and TARGET in strings(p))

    if mode == "batch":
        @app.handler("orders", group=unique, token="body.id", batch=4)
        def handle_batch(msgs: list[Message], tx) -> None:
            for m in msgs:
                calls[m.body["id"]] += 1
                write(tx, m.body["id"])
    else:
        @app.handler("orders", group=unique, token="body.id")
        def handle(msg: Message, tx) -> None:
            calls[msg.body["id"]] += 1
            write(tx, msg.body["id"])

    app.publish_many("orders", [{"id": t} for t in TOKENS])
    with structlog.testing.capture_logs() as logs:
        app.run(until_idle=True)

    assert trap.sprung == 1, "the trap sprang once, on the target's transaction"
    assert any(disconnect for _, disconnect in trap.errors), trap.errors  # the client saw the connection die
    assert trap.connects_after >= 1  # and reconnected
    commit_failed = [e for e in logs if e["event"] == "store.unavailable" and e.get("step") == "commit"]
    if moment == "mid_transaction":  # the handler's own next statement failed, and it ran again
        assert any(statement and statement.startswith("select count(*)") for statement, _ in trap.errors)
        assert calls[TARGET] >= 2
    elif moment == "commit_lost":  # the commit failed, the server rolled back, the handler ran again
        assert commit_failed and calls[TARGET] >= 2
    else:  # the commit failed for the client but the server had committed: the handler never ran again
        assert postgres_proxy.replies_lost == 1 and commit_failed and calls[TARGET] == 1
        assert app.stats()["duplicate"] >= 1  # the rerun found the token claimed by the unseen commit
    assert effects(direct, unique) == dict.fromkeys(TOKENS, 1)  # nothing lost, nothing doubled
    assert app.dead_letters(unique) == []
    app.close()


def strings(parameters: Any) -> list[str]:
    """The text values of a statement's parameters (whatever names the store gives them)."""
    values = parameters.values() if isinstance(parameters, dict) else parameters
    return [value for value in values if isinstance(value, str)]


def lease_statement(token: str) -> Match:
    """The lease's insert of ``token`` (a token record in state in_progress)."""
    return lambda sql, p: "INSERT INTO reliable_tokens" in sql and {token, "in_progress"} <= set(strings(p))


def result_statement(token: str) -> Match:
    """The insert of ``token``'s stored result (the handler returns "sent <token>")."""
    return lambda sql, p: "INSERT INTO reliable_tokens" in sql and any(f"sent {token}" in s for s in strings(p))


@pytest.mark.parametrize(("moment", "match"), [
    ("mid_transaction", lease_statement),
    ("commit_lost", lease_statement),
    ("reply_lost", lease_statement),
    ("reply_lost", result_statement),
], ids=["lease_mid_transaction", "lease_commit_lost", "lease_reply_lost", "result_reply_lost"])
def test_store_cut_around_the_lease(
    tmp_path, postgres_url: str, postgres_proxy: TcpProxy, direct: Engine, unique: str, moment: str, match: Callable
) -> None:
    app = start(tmp_path, postgres_url, postgres_proxy)
    calls: Counter[str] = Counter()
    trap = Trap(store_engine(app), postgres_proxy, match=match(f"{TARGET}"), moment=moment)

    @app.handler("mail", group=unique, token="body.id", lease=30.0)
    def send(msg: Message) -> str:
        calls[msg.body["id"]] += 1
        with direct.begin() as conn:  # the side effect, outside the store's transactions
            conn.execute(text(f"insert into {unique} (token) values (:t)"), {"t": msg.body["id"]})
        return f"sent {msg.body['id']}"

    app.publish_many("mail", [{"id": t} for t in TOKENS])
    with structlog.testing.capture_logs() as logs:
        app.run(until_idle=True)

    events = [e["event"] for e in logs]
    assert trap.sprung == 1 and any(disconnect for _, disconnect in trap.errors), trap.errors
    assert trap.connects_after >= 1
    assert any(e["event"] == "store.unavailable" and e.get("step") == "commit" for e in logs)
    assert calls[TARGET] == 1  # the handler ran once for the target, whatever its lease went through
    if match is lease_statement and moment == "reply_lost":
        # the lease was taken although the client saw its commit fail: the redelivery met our own
        # orphaned lease, waited for it to expire, then took it over
        assert postgres_proxy.replies_lost == 1 and "lease_held" in events
    elif match is lease_statement:
        assert app.stats()["deferred"] >= 1  # no lease, no handler: the message came back
    else:
        assert postgres_proxy.replies_lost == 1
    assert effects(direct, unique) == dict.fromkeys(TOKENS, 1)  # nothing lost, nothing doubled
    app.close()
    duplicate = test_app(tmp_path / "again", store=postgres_url, cache="none")

    @duplicate.handler("mail", group=unique, token="body.id", lease=30.0)
    def send_again(msg: Message) -> str:
        raise AssertionError("a stored result answers every token")

    duplicate.publish_many("mail", [{"id": t} for t in TOKENS])
    duplicate.run(until_idle=True)
    assert duplicate.stats()["duplicate"] == len(TOKENS)
    duplicate.close()
