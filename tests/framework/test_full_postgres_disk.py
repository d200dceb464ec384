"""The framework on a PostgreSQL whose disk fills up, for real.

The store is a database whose tablespace is a small tmpfs (``small_postgres``,
`tests.disk.postgres_on`): the handler's own table, the token claims, the
dead letters and the outbox rows all live there; the WAL does not (it stays
in the server's data directory, on the machine's disk), and neither does the
embedded broker's data. Mid-run the tmpfs is filled until ENOSPC, and
PostgreSQL refuses whatever must grow a file with SQLSTATE 53100
(``disk_full``: "could not extend file ... No space left on device"). Space
comes back a minute later on the fake clock. A full disk is an outage, not
poison: every refused message is deferred (no attempt of its own), none is
dead-lettered or lost, and each effect exists exactly once afterwards; the
worker fetches nothing more until the store takes a write again.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from structlog.testing import capture_logs

from backends.store.postgresql import COPY_CLAIM_MIN
from backends.store.refusals import database_errors
from backends.types import Message
from reliable import App, Middleware
from reliable.handler import Handler
from reliable.testing import test_app
from tests.disk import SmallDatabase, SpaceComesBack
from tests.framework.conftest import create_effects, effects

ORDERS = 12
FILL_AT = 4  # the order whose handler fills the disk
MAX_REDELIVERIES = 2
DOCUMENT = 16_000  # random bytes: out of line in the TOAST table, which must grow for each one


def refusals(logs: list[dict[str, Any]]) -> list[tuple[str | None, str]]:
    """(SQLSTATE, statement) of the database error behind each deferred message."""
    found = []
    for entry in logs:
        if entry["event"] == "message_deferred":
            error = next(database_errors(entry["exc_info"]), None)
            assert error is not None, entry["error"]  # a deferral without a database error behind it
            found.append((getattr(error.orig, "sqlstate", None), " ".join(str(error.statement).split())[:40]))
    return found


def postgres_app(database: SmallDatabase, tmp_path, clock: SpaceComesBack,
                 settings: dict[str, str] | None = None) -> App:
    app = test_app(tmp_path, clock=clock, store=database.url, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_RETRY__MAX_REDELIVERIES": str(MAX_REDELIVERIES), **(settings or {})})
    create_effects(app, "effects")
    with app.store.transaction() as tx:
        tx.execute(text("create table documents (token text, body bytea)"))
    return app


def register(app: App, shape: str, clock: SpaceComesBack, disk, attempts: Counter[int]) -> None:
    """The order handler in ``shape``: a document row and a published message per order."""
    insert = text("insert into documents values (:t, :b)")

    def write(tx: Any, messages: list[Any]) -> list[Any]:
        for msg in messages:
            attempts[msg.body["id"]] = max(attempts[msg.body["id"]], msg.attempt)
            if msg.body["id"] == FILL_AT and clock.ballast is None:
                clock.fill(disk)  # mid-run: the disk is full from here on
            tx.publish("shipped", {"id": msg.body["id"], "pad": os.urandom(DOCUMENT).hex()})
        return [{"t": f"order-{msg.body['id']}", "b": os.urandom(DOCUMENT)} for msg in messages]

    if shape == "sync":
        @app.handler("orders", token="body.id")
        def order(msg, tx):
            tx.execute(insert, write(tx, [msg]))
    elif shape == "async":
        @app.handler("orders", token="body.id")
        async def order(msg, tx):
            await tx.execute(insert, write(tx, [msg]))
    else:
        @app.handler("orders", token="body.id", batch=3)
        def order(messages, tx):
            tx.execute(insert, write(tx, messages))

    @app.handler("shipped", token="body.id")
    def shipped(msg, tx):
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"),
                   {"t": f"shipped-{msg.body['id']}", "a": msg.attempt})


@pytest.mark.parametrize("shape", ["sync", "async", "batch"])
def test_a_worker_rides_out_a_full_postgresql_disk_and_every_effect_happens_once(
        small_postgres: SmallDatabase, tmp_path, shape: str) -> None:
    clock = SpaceComesBack()
    app = postgres_app(small_postgres, tmp_path, clock)
    attempts: Counter[int] = Counter()  # the transport's delivery count each order reached the handler with
    register(app, shape, clock, small_postgres.disk, attempts)
    try:
        for n in range(ORDERS):
            app.publish("orders", {"id": n})
        with capture_logs() as logs:
            app.run(until_idle=True)  # must not raise
        assert clock.ballast is not None and clock.ballast.hit_enospc, "the disk never filled"
        assert not clock.ballast.path.exists(), "space never came back"
        refused = refusals(logs)
        assert refused and {state for state, _ in refused} == {"53100"}, Counter(refused)
        # a message the full disk refused was deferred once: the worker fetched nothing more until
        # the store took a write (`StoreGate`), not one delivery every round of the outage
        assert max(attempts.values()) == 2, attempts
        events = Counter(entry["event"] for entry in logs)
        assert events["dead_lettered"] == 0 and events["redelivery_scheduled"] == 0, events
        assert app.dead_letters("order") == [] and app.dead_letters("shipped") == []
        with app.store.transaction() as tx:
            stored = tx.execute(text("select token, count(*), min(length(body)) from documents group by token"))
            documents = sorted(tuple(row) for row in stored)
            unsent = tx.execute(text("select count(*) from reliable_outbox where sent_at is null")).scalar()
        assert documents == sorted((f"order-{n}", 1, DOCUMENT) for n in range(ORDERS))
        assert effects(app) == sorted(f"shipped-{n}" for n in range(ORDERS))
        assert unsent == 0
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()


def test_a_dead_letter_or_outbox_row_refused_by_a_full_postgresql_disk_waits_for_space(
        small_postgres: SmallDatabase, tmp_path) -> None:
    clock = SpaceComesBack()
    app = postgres_app(small_postgres, tmp_path, clock)
    delivered: dict[str, int] = {}

    # no claim: the outbox row (a notice) or the dead-letter record (a broken one: poison at once)
    # is the transaction's only write; both are fetched together, before the disk fills
    @app.handler("notices", token=None)
    def notice(msg, tx):
        delivered[msg.body["kind"]] = msg.attempt  # the transport's count of its deliveries
        if clock.ballast is None:
            clock.fill(small_postgres.disk)
        if msg.body["kind"] == "broken":
            raise TypeError("a bug: dead-lettered at once")
        tx.publish("shipped", {"id": msg.body["id"], "pad": os.urandom(DOCUMENT).hex()})

    @app.handler("shipped", token="body.id")
    def shipped(msg, tx):
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"),
                   {"t": f"shipped-{msg.body['id']}", "a": msg.attempt})

    try:
        app.publish("notices", {"kind": "notice", "id": 1})
        app.publish("notices", {"kind": "broken", "id": 2, "pad": os.urandom(DOCUMENT).hex()})
        with capture_logs() as logs:
            app.run(until_idle=True)
        assert clock.ballast is not None and clock.ballast.hit_enospc and not clock.ballast.path.exists()
        refused = Counter(refusals(logs))
        statements = {statement.split(" (")[0] for _, statement in refused}
        assert statements == {"INSERT INTO reliable_outbox", "INSERT INTO reliable_dead_letters"}, refused
        assert {state for state, _ in refused} == {"53100"}, refused
        assert delivered == {"notice": 2, "broken": 2}, delivered  # refused once, done once space was back
        [letter] = app.dead_letters("notice")  # recorded once space was back, as the first attempt
        assert (letter.failure.error_type, letter.failure.attempts) == ("builtins.TypeError", 1)
        assert effects(app) == ["shipped-1"]
        with app.store.transaction() as tx:
            assert tx.execute(text("select count(*) from reliable_outbox where sent_at is null")).scalar() == 0
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()


class FillsOnFirstMessage(Middleware):
    """Fills the disk when the first message enters the pipeline: after the worker fetched it
    (its store took a write then), before its tokens are claimed."""

    def __init__(self, clock: SpaceComesBack, disk: Path) -> None:
        self.clock, self.disk = clock, disk

    def before_message(self, handler: Handler, message: Message) -> None:
        if self.clock.ballast is None:
            self.clock.fill(self.disk)


def test_a_batch_claimed_with_copy_on_a_full_postgresql_disk_is_deferred(small_postgres: SmallDatabase,
                                                                         tmp_path) -> None:
    """A batch this large claims its tokens with ``COPY`` (`claim_by_copy`), whose psycopg error
    the store wraps itself: PostgreSQL's refusal there is an outage too."""
    clock = SpaceComesBack()
    app = postgres_app(small_postgres, tmp_path, clock, {"RELIABLE_RETRY__INITIAL_DELAY": "20",
                                                         "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    handled: Counter[int] = Counter()

    @app.handler("events", token="body.id", batch=COPY_CLAIM_MIN)
    def record(messages, tx):
        handled.update(msg.body["id"] for msg in messages)

    try:
        app.publish_many("events", [{"id": n} for n in range(COPY_CLAIM_MIN)])
        app.add_middleware(FillsOnFirstMessage(clock, small_postgres.disk))
        with capture_logs() as logs:
            app.run(until_idle=True)
        refused = Counter(refusals(logs))
        assert {statement for _, statement in refused} == {"COPY reliable_tokens (namespace, token, "}, refused
        assert {state for state, _ in refused} == {"53100"}, refused
        assert set(handled) == set(range(COPY_CLAIM_MIN)) and set(handled.values()) == {1}  # once space is back
        assert app.dead_letters("record") == []
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()
