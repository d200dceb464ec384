"""Where the outbox keeps its rows: on PostgreSQL sent rows move out of ``reliable_outbox`` (kept,
listed and purged from ``reliable_outbox_sent_rows``), on SQLite they are marked where they are;
a store written by a previous version (its sent rows in the other place, or no table of sent
rows) keeps working, and only the relay's marks commit without waiting for the disk.

Real SQLite files and the shared PostgreSQL, the embedded broker; each test in an outbox of
its own name.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url

from backends.errors import BackendRefusedError, BackendUnavailableError, OutboxMessageError
from backends.store import SqlStore
from backends.store.outbox import RowState
from reliable import App
from reliable.outbox import Relay
from reliable.testing import FakeClock, test_app
from tests.cluster.ports import free_ports
from tests.waiting import wait_until

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


def test_sent_rows_stay_listed_until_the_retention_moved_out_on_postgresql_and_in_place_on_sqlite(
    app: App, unique: str, clock: FakeClock, store_url: str
) -> None:
    """On PostgreSQL a sent row leaves ``reliable_outbox`` (its update would be a new version of the
    row in three indexes); on SQLite it is marked where it is (its move wrote 2.6 times the pages)."""
    with app.store.transaction() as tx:
        first = tx.publish("orders", {"n": 1}, key="k")
        tx.publish("orders", "x" * 5_000_000, key="j")  # above max_record_size: refused, FAILED, stays
        third = tx.publish("orders", {"n": 3}, key="k")
    app.relay().drain()

    in_place = store_url.startswith("sqlite")
    assert outbox_rows(app, unique) == (3 if in_place else 1)  # PostgreSQL: only the unsent (FAILED) row
    with app.store.transaction() as tx:
        moved = tx.execute(text("select count(*) from reliable_outbox_sent_rows where outbox = :n"), {"n": unique})
        assert moved.scalar() == (0 if in_place else 2)
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


def test_on_sqlite_status_counts_the_sent_rows_kept_in_place_without_reading_them(
    tmp_path: Path, unique: str
) -> None:
    """Sent rows stay in ``reliable_outbox`` on SQLite, a day of them at the default retention:
    ``status`` (every running relay's metrics, each second) counts them in the index of their
    ``sent_at`` alone, and reads the unsent rows through theirs. Read from the table, 100,000
    sent rows made a status take 41 ms instead of 3."""
    app = test_app(tmp_path, store=f"sqlite:///{tmp_path / 'store.db'}",
                   transport=f"embedded://{tmp_path / 'broker'}", settings={"RELIABLE_OUTBOX__NAME": unique})
    with app.store.transaction() as tx:
        tx.publish("orders", {"n": 1}, key="k")
    app.relay().drain()
    statements: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "reliable_outbox" in statement and statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    event.listen(app.store.engine, "before_cursor_execute", record)
    try:
        assert app.store.outbox.status().sent == 1
    finally:
        event.remove(app.store.engine, "before_cursor_execute", record)
    with app.store.engine.connect() as connection:
        plans = [row[-1] for statement, parameters in statements
                 for row in connection.exec_driver_sql(f"explain query plan {statement}", parameters)]
    app.close()
    reads = [p for p in plans if p.startswith(("SCAN reliable_outbox ", "SEARCH reliable_outbox "))
             or p in ("SCAN reliable_outbox", "SEARCH reliable_outbox")]
    assert len(reads) == 2, plans  # the unsent rows, the sent ones kept in place
    assert all("COVERING INDEX" in p or "INDEX reliable_outbox_unsent_key " in p
               or "INDEX reliable_outbox_sent (outbox=? AND sent_at=?)" in p for p in reads), reads


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
    """Sent rows kept in ``reliable_outbox`` are under its unique index: a second message under an
    id the caller chose is refused by name (checked before the rows' ``INSERT``, which the index
    would fail). Moved out, they still are, on sync and async transactions;
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
    status = app.store.outbox.status()  # the refused transactions wrote nothing
    assert (status.backlog, status.failed, status.sent) == (0, 0, 1)

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


def test_a_relay_pass_alone_on_postgresql_reads_each_claimed_row_once(
    tmp_path: Path, postgres_url: str, unique: str
) -> None:
    """The per-key check of a claim reads the rows of the claimed keys back only when some unsent
    row up to the last claimed one is not in the claim (another relay's, or a FAILED one): a relay
    alone read every claimed row twice, which cost the database half as much again as the claim."""
    app = test_app(tmp_path, store=postgres_url, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_OUTBOX__NAME": unique})
    read: list[int] = []

    def count_rows(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "reliable_outbox" in statement:
            read.append(max(cursor.rowcount, 0))

    with app.store.transaction() as tx:
        for n in range(200):
            tx.publish("orders", {"n": n}, key=f"k{n % 7}")
    event.listen(app.store.engine, "after_cursor_execute", count_rows)
    try:
        assert app.relay().step() == 200
    finally:
        event.remove(app.store.engine, "after_cursor_execute", count_rows)
        app.close()
    assert sum(read) <= 201  # the claim's 200 rows and one count


def test_a_relay_pass_that_failed_leaves_no_connection_committing_lazily(
    tmp_path: Path, store_url: str, unique: str
) -> None:
    """The claim's lazy commit is per transaction (PostgreSQL's SET LOCAL) or set back before the
    next one begins (SQLite's synchronous, per connection): after a pass cut by a transport
    outage or by an error that stops the relay in the middle of it (a refused login; a client
    library's own error only fails its row), the pool's connection a handler gets next and the
    async store's commit durably."""
    query, relayed, durable = SYNCHRONOUS[store_url.split(":")[0].split("+")[0]]
    (port,) = free_ports(1)  # nothing listens: the transport is down
    app = test_app(tmp_path, store=store_url, transport=f"redis://127.0.0.1:{port}/0?namespace={unique}",
                   settings={"RELIABLE_OUTBOX__NAME": unique})

    @contextmanager
    def broken(topic: str, headers: Any) -> Iterator[None]:
        raise BackendRefusedError("[transport] url", "a login refused mid-pass")
        yield

    relays = {BackendUnavailableError: app.relay(),
              BackendRefusedError: Relay(app.store, app.transport, app.settings.outbox, app.clock, hook=broken)}
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


@pytest.fixture
def own_database(postgres_url: str, unique: str) -> Iterator[str]:
    """A PostgreSQL database of the test's own: an index built CONCURRENTLY waits for every older
    transaction of its database, which in the shared one are other tests'."""
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"create database {unique}"))
    try:
        yield make_url(postgres_url).set(database=unique).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"drop database {unique} with (force)"))
        admin.dispose()


_MESSAGE_ID_INDEX = "reliable_outbox_sent_rows_message_id"
_INDEX_VALID = text(f"select indisvalid from pg_index where indexrelid = '{_MESSAGE_ID_INDEX}'::regclass")
_SENT_ROW = text("insert into reliable_outbox_sent_rows (id, outbox, message_id, topic, headers, payload, deliver_at,"
                 " state, created_at) values (:id, 'o', :id, 't', '{}', '', 0, 'sent', 0)")


def made_tables(url: str) -> None:
    store = SqlStore(url)
    store.outbox.status()  # the first use makes the tables
    store.close()


def test_an_index_added_to_a_table_of_sent_rows_lets_writes_through_while_it_is_built(own_database: str) -> None:
    """A table of sent rows made before its ``message_id`` index (by an earlier version) gets it
    at the next start, built CONCURRENTLY: a plain build waits for the writers of the table and
    locks every write after it out until it ends, which on a large table stops the relays. Here a
    relay's transaction is open when the build starts; another relay's write must go through."""
    made_tables(own_database)  # as an earlier version left them, less the index
    engine = create_engine(own_database)
    with engine.begin() as connection:
        connection.execute(text(f"drop index {_MESSAGE_ID_INDEX}"))
    store = SqlStore(own_database)
    watching = engine.execution_options(isolation_level="AUTOCOMMIT")  # each look at pg_stat_activity anew
    with engine.connect() as open_writer, engine.connect() as later_writer, watching.connect() as watcher:
        open_writer.execute(_SENT_ROW, {"id": 1})  # its transaction stays open
        building = threading.Thread(target=store.outbox.status)  # the first use builds the index
        building.start()
        wait_until(lambda: watcher.execute(text(
            "select count(*) from pg_stat_activity where query ilike 'create index%' and wait_event_type = 'Lock'"
        )).scalar(), "the index's build waiting for the open transaction")
        later_writer.execute(text("set lock_timeout = '10s'"))  # a plain build: locked out until it ends
        later_writer.execute(_SENT_ROW, {"id": 2})
        later_writer.commit()
        open_writer.commit()
        building.join()
        assert open_writer.execute(_INDEX_VALID).scalar() is True
    store.close()
    engine.dispose()


def test_an_index_whose_build_died_is_built_anew(own_database: str) -> None:
    """A CONCURRENTLY build that dies (its process killed) leaves the index in the catalog but
    unusable: the next start builds it again, where a check of its name alone kept it so."""
    made_tables(own_database)
    engine = create_engine(own_database)
    with engine.begin() as connection:  # as a dead build leaves it
        connection.execute(text(f"update pg_index set indisvalid = false where indexrelid = '{_MESSAGE_ID_INDEX}'::regclass"))
    store = SqlStore(own_database)
    store.outbox.status()
    with engine.connect() as connection:
        assert connection.execute(_INDEX_VALID).scalar() is True
    store.close()
    engine.dispose()
