"""Where the outbox keeps its rows: sent rows move out of ``reliable_outbox`` (kept, listed and
purged from ``reliable_outbox_sent_rows``), a store written by the previous version (its sent
rows updated in place, no table of sent rows) keeps working, and only the relay's marks commit
without waiting for the disk.

Real SQLite files and the shared PostgreSQL, the embedded broker; each test in an outbox of
its own name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from backends.errors import BackendUnavailableError, OutboxMessageError
from backends.store import SqlStore
from backends.store.outbox import RowState
from reliable import App
from reliable.outbox import Relay
from reliable.testing import FakeClock, test_app
from tests.cluster.ports import free_ports

SYNCHRONOUS = {  # what the relay's claim and any other transaction see, per database
    "sqlite": ("pragma synchronous", 1, 2),  # NORMAL, FULL
    "postgresql": ("show synchronous_commit", "off", "on"),
}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def app(tmp_path: Path, store_url: str, unique: str, clock: FakeClock) -> Iterator[App]:
    app = test_app(tmp_path, store=store_url, clock=clock, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_OUTBOX__NAME": unique})
    yield app
    app.close()


def outbox_rows(app: App, unique: str) -> int:
    with app.store.transaction() as tx:
        return int(tx.execute(text("select count(*) from reliable_outbox where outbox = :n"), {"n": unique}).scalar())


def test_sent_rows_leave_the_outbox_table_and_stay_listed_until_the_retention(
    app: App, unique: str, clock: FakeClock
) -> None:
    with app.store.transaction() as tx:
        first = tx.publish("orders", {"n": 1}, key="k")
        tx.publish("bad/topic", {"n": 2}, key="j")  # refused by the broker: FAILED, stays
        third = tx.publish("orders", {"n": 3}, key="k")
    app.relay().drain()

    assert outbox_rows(app, unique) == 1  # only the unsent (FAILED) row: its indexes hold no sent row
    status = app.store.outbox.status()
    assert (status.backlog, status.failed, status.sent) == (0, 1, 2)
    listed = app.store.outbox.rows()
    assert [(r.message_id, r.state) for r in listed] == [
        (first, RowState.SENT), (listed[1].message_id, RowState.FAILED), (third, RowState.SENT)]
    sent = app.store.outbox.rows(RowState.SENT, after_id=listed[0].id)
    assert [(r.message_id, r.key, r.payload, r.sent_at) for r in sent] == [(third, "k", b'{"n":3}', clock.time())]
    assert [r.message_id for r in app.store.outbox.rows(limit=1)] == [first]

    clock.advance(10)
    assert app.store.outbox.purge_sent(clock.time() - 5) == 2
    assert [r.state for r in app.store.outbox.rows()] == [RowState.FAILED]


def test_sent_rows_updated_in_place_by_the_previous_version_are_counted_listed_and_purged(
    app: App, unique: str, clock: FakeClock
) -> None:
    """During an upgrade a relay of the previous version marks rows SENT where they are."""
    with app.store.transaction() as tx:
        old = tx.publish("orders", {"n": 1}, key="k")
    with app.store.transaction() as tx:  # what the previous version's relay did with a sent row
        tx.execute(text("update reliable_outbox set state = 'sent', sent_at = :t where message_id = :m"),
                   {"t": clock.time(), "m": old})
    with app.store.transaction() as tx:
        new = tx.publish("orders", {"n": 2}, key="k")
    app.relay().drain()

    assert app.store.outbox.status().sent == 2
    assert [(r.message_id, r.state) for r in app.store.outbox.rows()] == [(old, RowState.SENT), (new, RowState.SENT)]
    assert [r.message_id for r in app.store.outbox.rows(RowState.SENT)] == [old, new]
    assert app.store.outbox.purge_sent(clock.time() + 1) == 2
    assert app.store.outbox.status().sent == 0


def test_a_sqlite_store_created_by_the_previous_version_gets_the_sent_rows_table(tmp_path: Path, unique: str) -> None:
    path = tmp_path / "store.db"
    store = SqlStore(f"sqlite:///{path}", outbox=unique)
    with store.transaction() as tx:
        kept = tx.publish("orders", {"n": 1})
    with store.transaction() as tx:  # the previous version had no table of sent rows, and updated them
        tx.execute(text("drop table reliable_outbox_sent_rows"))
        tx.execute(text("update reliable_outbox set state = 'sent', sent_at = 1"))
    store.close()

    app = test_app(tmp_path, store=f"sqlite:///{path}", transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_OUTBOX__NAME": unique})
    with app.store.transaction() as tx:
        new = tx.publish("orders", {"n": 2})
    app.relay().drain()
    assert [(r.message_id, r.state) for r in app.store.outbox.rows()] == [(kept, RowState.SENT), (new, RowState.SENT)]
    assert app.store.outbox.purge_sent(app.clock.time() + 1) == 2
    app.close()


def test_only_the_relays_marks_commit_without_waiting_for_the_disk(app: App, store_url: str, unique: str) -> None:
    """A lost mark is a resend under the same message ids; every other commit stays durable,
    also on a connection the relay used just before."""
    query, relayed, durable = SYNCHRONOUS[store_url.split(":")[0].split("+")[0]]
    for n in range(3):
        with app.store.transaction() as tx:
            assert tx.execute(text(query)).scalar() == durable
            tx.publish("orders", {"n": n})
        with app.store.outbox.claim(10) as claimed:
            assert claimed._connection.execute(text(query)).scalar() == relayed
            claimed.sent(claimed.rows)
    with app.store.transaction() as tx:
        assert tx.execute(text(query)).scalar() == durable
    assert app.store.outbox.status().sent == 3


def test_a_message_id_chosen_again_after_its_row_was_sent_is_refused_until_the_retention(
    app: App, unique: str, clock: FakeClock
) -> None:
    """Sent rows kept in ``reliable_outbox`` were under its unique index: a second message under
    an id the caller chose was refused. Moved out, they still are, on sync and async transactions;
    a message id drawn by the store, or chosen anew after the retention, is not checked or passes."""
    with app.store.transaction() as tx:
        tx.publish("orders", {"n": 1}, message_id=f"{unique}-1")
    app.relay().drain()

    with pytest.raises(OutboxMessageError, match=f"'{unique}-1' was sent already"):
        with app.store.transaction() as tx:
            tx.publish("orders", {"n": 2}, message_id=f"{unique}-1")
            tx.publish("orders", {"n": 3})

    async def publish_async() -> None:
        store = app.store.open_async(1)
        try:
            async with store.transaction() as tx:
                tx.publish("orders", {"n": 4}, message_id=f"{unique}-1")
        finally:
            await store.close()

    with pytest.raises(OutboxMessageError, match="was sent already"):
        asyncio.run(publish_async())
    assert outbox_rows(app, unique) == 0  # the refused transactions wrote nothing
    assert app.store.outbox.status().sent == 1

    clock.advance(10)
    assert app.store.outbox.purge_sent(clock.time()) == 1
    with app.store.transaction() as tx:  # its sent row gone: the id names no message any more
        tx.publish("orders", {"n": 5}, message_id=f"{unique}-1")
    assert outbox_rows(app, unique) == 1


def test_a_row_moved_while_status_or_list_reads_is_counted_and_listed_once(
    tmp_path: Path, postgres_url: str, unique: str
) -> None:
    """PostgreSQL reads run each statement on a snapshot of its own (autocommit): a row a relay
    moves between a read of ``reliable_outbox`` and one of the sent rows was counted as pending
    and sent, and listed twice. The relay's move is made to land just before the read of the
    sent rows (a hook on the real statement, the move a real relay pass on another connection)."""
    app = test_app(tmp_path, store=postgres_url, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_OUTBOX__NAME": unique})
    moving = {"armed": False}

    def move_first(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if moving["armed"] and "reliable_outbox_sent_rows" in statement and "SELECT" in statement.upper()[:20]:
            moving["armed"] = False
            assert app.relay().step() == 2

    event.listen(app.store.engine, "before_cursor_execute", move_first)
    try:
        for read in (lambda: app.store.outbox.status(), lambda: app.store.outbox.rows()):
            with app.store.transaction() as tx:
                tx.publish("orders", {"n": 1})
                tx.publish("orders", {"n": 2})
            moving["armed"] = True
            found = read()
            assert not moving["armed"]  # the move ran during the read
            if isinstance(found, list):
                assert len({r.id for r in found}) == len(found) == 4  # two sent earlier, two now
                assert {r.state for r in found} == {RowState.SENT}
            else:
                assert (found.backlog, found.sent) in ((2, 0), (0, 2))  # before the move, or after
    finally:
        event.remove(app.store.engine, "before_cursor_execute", move_first)
        app.close()


def test_a_relay_pass_that_failed_leaves_no_connection_committing_lazily(
    tmp_path: Path, store_url: str, unique: str
) -> None:
    """The claim's lazy commit is per transaction (PostgreSQL's SET LOCAL) or set back before the
    next one begins (SQLite's synchronous, per connection): after a pass cut by a transport
    outage or by an exception in the middle of it, the pool's connection a handler gets next and
    the async store's commit durably."""
    query, relayed, durable = SYNCHRONOUS[store_url.split(":")[0].split("+")[0]]
    (port,) = free_ports(1)  # nothing listens: the transport is down
    app = test_app(tmp_path, store=store_url, transport=f"redis://127.0.0.1:{port}/0?namespace={unique}",
                   settings={"RELIABLE_OUTBOX__NAME": unique})

    @contextmanager
    def broken(topic: str, headers: Any) -> Iterator[None]:
        raise RuntimeError("a middleware's bug")
        yield

    relays = {BackendUnavailableError: app.relay(),
              RuntimeError: Relay(app.store, app.transport, app.settings.outbox, app.clock, hook=broken)}
    try:
        for error, relay in relays.items():
            with app.store.transaction() as tx:
                tx.publish("orders", {"n": 1})
            with pytest.raises(error):
                relay.step()
            with app.store.transaction() as tx:
                assert tx.execute(text(query)).scalar() == durable
            with app.store.outbox.claim(10) as claimed:  # the same connection, lazy again
                assert claimed._connection.execute(text(query)).scalar() == relayed
                held = claimed.rows
            assert held  # the row was still there to claim
            with app.store.transaction() as tx:
                assert tx.execute(text(query)).scalar() == durable

        async def async_level() -> Any:
            store = app.store.open_async(1)
            try:
                async with store.transaction() as tx:
                    return (await tx.execute(text(query))).scalar()
            finally:
                await store.close()

        assert asyncio.run(async_level()) == durable
        assert app.store.outbox.status().backlog == 2  # nothing was marked
    finally:
        app.close()
