"""A store whose disk is full holds fetching, as a store out of reach does (`StoreGate`).

A database on a full disk still answers reads, so a read alone (``ping``)
cannot tell it from one that takes writes: a worker that opened its gate on
a read fetched, deferred and spent a delivery of the message every round of
the outage, and a long one dead-lettered a message that did nothing wrong
once the worker had forgotten its deferrals (a restart). These tests count
the deliveries a full disk costs: one, whatever its length.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text
from structlog.testing import capture_logs

from reliable import App
from reliable.testing import FakeClock, test_app
from tests.disk import SmallDatabase, SpaceComesBack
from tests.framework.conftest import create_effects, effects

INSERT = text("insert into effects (token, attempt) values (:t, :a)")
DOCUMENT = text("insert into documents (token, body) values (:t, :b)")
OUTAGE = 600.0  # seconds on the fake clock the disk stays full: a long outage
MAX_REDELIVERIES = 2


def app_on(disk: Path, broker: Path, clock: FakeClock, store: str | None = None) -> App:
    """An app whose store is on ``disk`` (SQLite, else ``store``) and whose broker is not: only
    the store's disk fills. Its ``documents`` take rows that must grow the database's files."""
    app = test_app(disk, clock=clock, transport=f"embedded://{broker}", store=store,
                   settings={"RELIABLE_RETRY__MAX_REDELIVERIES": str(MAX_REDELIVERIES),
                             "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    create_effects(app, "effects")
    with app.store.transaction() as tx:
        tx.execute(text(f"create table if not exists documents (token text, body {'bytea' if store else 'blob'})"))
    return app


@pytest.fixture(params=["sqlite", "postgresql"])
def full_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str | None]:
    """The small disk a store lives on, and the store's URL (None: SQLite on the disk)."""
    if request.param == "sqlite":
        return request.getfixturevalue("small_disk"), None
    database: SmallDatabase = request.getfixturevalue("small_postgres")
    return database.disk, database.url


@pytest.mark.parametrize("shape", ["sync", "async"])
def test_a_long_full_store_disk_costs_a_message_one_delivery(full_store: tuple[Path, str | None], tmp_path: Path,
                                                             shape: str) -> None:
    disk, url = full_store
    clock = SpaceComesBack(OUTAGE)
    app = app_on(disk, tmp_path / "broker", clock, url)
    attempts: list[int] = []

    def write(msg, tx):
        attempts.append(msg.attempt)
        if clock.ballast is None:
            clock.fill(disk)  # mid-run: from here on the store cannot write
        return tx.execute(DOCUMENT, {"t": msg.body["id"], "b": os.urandom(16_000)})  # PostgreSQL: TOAST grows

    if shape == "sync":
        app.handler("orders", token="body.id")(write)
    else:
        @app.handler("orders", token="body.id")
        async def order(msg, tx):
            await write(msg, tx)

    try:
        app.publish("orders", {"id": 1})
        with capture_logs() as logs:
            app.run(until_idle=True)
        assert clock.ballast is not None and clock.ballast.hit_enospc, "the disk never filled"
        assert not clock.full, "space never came back"
        events = Counter(entry["event"] for entry in logs)
        assert app.dead_letters("order") == []
        # the delivery that met the full disk was deferred; the next one came once space was back
        assert (events["message_deferred"], attempts) == (1, [1, 2]), (events, attempts[:5], len(attempts))
        held = [e["error"] for e in logs if e["event"] == "store_unavailable"]
        assert held and ("disk is full" in held[0] or "No space left" in held[0]), held[:1]
        with app.store.transaction() as tx:
            assert tx.execute(text("select token, length(body) from documents")).all() == [("1", 16_000)]
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()


class StopsMidway(SpaceComesBack):
    """`SpaceComesBack` that stops ``app`` halfway through the outage (its worker is restarted)."""

    app: App | None = None

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.app is not None and self.full and self.time() - self.filled_at >= self.outage / 2:
            self.app.stop()


@pytest.mark.parametrize("restarted", ["while the disk is full", "once space is back"])
def test_a_worker_restarted_after_a_full_store_disk_does_not_dead_letter(small_disk: Path, tmp_path: Path,
                                                                           restarted: str) -> None:
    clock = StopsMidway(OUTAGE)
    first = clock.app = app_on(small_disk, tmp_path / "broker", clock)
    attempts: list[tuple[str, int]] = []

    @first.handler("orders", token="body.id")
    def order(msg, tx):
        attempts.append(("first", msg.attempt))
        if clock.ballast is None:
            clock.fill(small_disk)
        tx.execute(INSERT, {"t": f"order-{msg.body['id']}", "a": msg.attempt})

    try:
        first.publish("orders", {"id": 1})
        first.run(until_idle=True)  # stopped halfway through the outage
        assert clock.full, "the first worker ran past the outage"
        first.close()
        clock.app = None
        if restarted == "once space is back":
            clock.ballast.free()  # the restarted worker has counted no deferral of the message
        second = app_on(small_disk, tmp_path / "broker", clock)  # knows nothing of the deferrals
        failed: list[int] = []

        @second.handler("orders", token="body.id", group="order")
        def order_again(msg, tx):
            attempts.append(("second", msg.attempt))
            if not failed:
                failed.append(msg.attempt)
                raise ConnectionError("a transient failure, once, after the outage")
            tx.execute(INSERT, {"t": f"order-{msg.body['id']}", "a": msg.attempt})

        second.run(until_idle=True)
        assert not clock.full, "space never came back"  # a worker started while full waited it out
        letters = [letter.failure.error_message for letter in second.dead_letters("order")]
        assert (letters, effects(second)) == ([], ["order-1"]), attempts[-3:]
        # the first delivery met the full disk, the second the transient failure, the third went through
        assert attempts == [("first", 1), ("second", 2), ("second", 3)], (attempts[:3], len(attempts))
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        first.close()
