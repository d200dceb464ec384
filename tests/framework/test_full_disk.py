"""The framework as users run it by default, on a full disk, for real.

A worker (`App.run`), the embedded broker (``embedded://``) and the SQLite
store share a small tmpfs (`tests.disk`). A handler writes a row and
publishes through the outbox; mid-run the disk is filled until ENOSPC, and
space comes back a minute later (on the fake clock). A full disk is an
outage, not poison: the worker rides it out, nothing is dead-lettered, every
effect happens once, the outbox rows are sent, and processing resumes by
itself once space is back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text
from structlog.testing import capture_logs

from reliable import App
from reliable.errors import DiskFullError
from reliable.testing import FakeClock, test_app
from tests.disk import SpaceComesBack, fill
from tests.framework.conftest import create_effects, effects
from tests.framework.test_outbox_cli import reliable_exe

ORDERS = 20


def embedded_app(disk: Path, clock: FakeClock) -> App:
    app = test_app(disk, clock=clock, transport=f"embedded://{disk / 'broker'}",
                   settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "2"})
    create_effects(app, "effects")
    return app


def test_a_worker_rides_out_a_full_disk_and_every_effect_happens_once(small_disk: Path) -> None:
    clock = SpaceComesBack()
    app = embedded_app(small_disk, clock)

    @app.handler("orders", token="body.id")
    def order(msg, tx):
        if msg.body["id"] == 5 and clock.ballast is None:
            clock.fill(small_disk)  # mid-run: the disk is full from here on
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"),
                   {"t": f"order-{msg.body['id']}", "a": msg.attempt})
        tx.publish("shipped", {"id": msg.body["id"]}, key=str(msg.body["id"]))

    @app.handler("shipped", token="body.id")
    def shipped(msg, tx):
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"),
                   {"t": f"shipped-{msg.body['id']}", "a": msg.attempt})

    try:
        for n in range(ORDERS):
            app.publish("orders", {"id": n})
        with capture_logs() as logs:
            app.run(until_idle=True)  # must not raise
        assert clock.ballast is not None and clock.ballast.hit_enospc, "the disk never filled"
        assert not clock.ballast.path.exists(), "space never came back"
        events = Counter(entry["event"] for entry in logs)
        assert events["message_deferred"] > 0, events  # the full disk was met, and ridden out
        refused = [e["error"] for e in logs if e["event"] == "transport_disk_full"]
        assert refused and all("full" in error for error in refused), [e for e in refused if "full" not in e]
        assert events["worker_stopped"] == 1
        expected = sorted([f"order-{n}" for n in range(ORDERS)] + [f"shipped-{n}" for n in range(ORDERS)])
        assert effects(app) == expected  # each exactly once, the outbox rows sent
        assert app.dead_letters("order") == [] and app.dead_letters("shipped") == []
        assert app.stats()["dead_lettered"] == 0
        with app.store.transaction() as tx:
            unsent = tx.execute(text("select count(*) from reliable_outbox where sent_at is null")).scalar()
        assert unsent == 0
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()



def test_a_message_that_waited_out_a_full_disk_keeps_its_attempts(small_disk: Path) -> None:
    """A disk with a little room left takes the worker's write probe (`StoreGate`) but not the
    handler's large write: the message is delivered and deferred again and again meanwhile."""
    clock = SpaceComesBack()
    app = test_app(small_disk, clock=clock, transport=f"embedded://{small_disk / 'broker'}",
                   settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "2", "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    create_effects(app, "effects")
    with app.store.transaction() as tx:
        tx.execute(text("alter table effects add column body blob"))
    after_the_outage: list[int] = []

    @app.handler("orders", token="body.id")
    def order(msg, tx):
        if clock.ballast is None:
            clock.fill(small_disk)
            clock.ballast.leave(ROOM)
        elif not clock.ballast.path.exists() and not after_the_outage:
            after_the_outage.append(msg.attempt)
            raise ConnectionError("a transient failure, once, after the outage")
        tx.execute(text("insert into effects (token, attempt, body) values (:t, :a, :b)"),
                   {"t": f"order-{msg.body['id']}", "a": msg.attempt, "b": b"\x01" * 3_000_000})

    try:
        app.publish("orders", {"id": 1})
        app.run(until_idle=True)
        assert clock.ballast is not None and clock.ballast.hit_enospc
        assert after_the_outage and after_the_outage[0] > 2  # delivered again meanwhile: past max_redeliveries
        assert [letter.failure.error_message for letter in app.dead_letters("order")] == []
        assert effects(app) == ["order-1"]
        assert app.stats()["redelivered"] == 1
    finally:
        clock.ballast.free() if clock.ballast is not None else None
        app.close()


def test_a_worker_on_a_full_broker_disk_keeps_its_group_and_does_not_spin(small_disk: Path) -> None:
    clock = SpaceComesBack()
    app = test_app(small_disk, clock=clock, transport=f"embedded://{small_disk / 'broker'}",
                   settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    create_effects(app, "effects")
    during_the_outage = []

    @app.handler("orders", token="body.id")
    def order(msg, tx):
        if clock.ballast is None:
            clock.fill(small_disk)
        if clock.ballast is not None and clock.ballast.path.exists():
            during_the_outage.append(round(clock.time() - clock.filled_at, 1))
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"), {"t": "order-1", "a": msg.attempt})

    try:
        app.publish("orders", {"id": 1})
        with capture_logs() as logs:
            app.run(until_idle=True)
        assert clock.ballast is not None and clock.ballast.hit_enospc
        assert effects(app) == ["order-1"]
        refused = [e for e in logs if e["event"] == "transport_disk_full"]
        assert refused and all("full" in e["error"] for e in refused), refused
        assert len(during_the_outage) <= 3, str(during_the_outage)
    finally:
        clock.ballast.free() if clock.ballast is not None else None
        app.close()


def test_a_worker_started_on_a_full_disk_begins_once_space_is_back(small_disk: Path) -> None:
    first = embedded_app(small_disk, FakeClock())
    first.publish("orders", {"id": 1})
    first.close()  # the broker's store and the SQLite store have files on the disk, then it fills
    clock = SpaceComesBack()
    clock.fill(small_disk)
    assert clock.ballast is not None and clock.ballast.hit_enospc
    app = test_app(small_disk, clock=clock, transport=f"embedded://{small_disk / 'broker'}")

    @app.handler("orders", token="body.id")
    def order(msg, tx):
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"),
                   {"t": f"order-{msg.body['id']}", "a": msg.attempt})

    try:
        with capture_logs() as logs:
            app.run(until_idle=True)
        assert not clock.ballast.path.exists(), "space never came back"
        # the worker waits for its store (`StoreGate`) before it fetches: the store names the disk
        refusals = [e["error"] for e in logs if e["event"] in ("store_unavailable", "transport_disk_full")]
        assert refusals and "is full" in refusals[0], refusals[:1]
        assert effects(app) == ["order-1"]
    finally:
        clock.ballast.free()
        app.close()

ROOM = 512 * 1024  # left free on the store's disk: a dead-letter record fits, the handler's write does not


@pytest.mark.parametrize("shape", ["sync", "async", "batch"])
def test_a_handler_write_refused_by_a_full_disk_is_deferred_not_dead_lettered(small_disk: Path, tmp_path: Path,
                                                                               shape: str) -> None:
    clock = SpaceComesBack()
    app = test_app(small_disk, clock=clock, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "2"})
    with app.store.transaction() as tx:
        tx.execute(text("create table documents (token text, body blob)"))
    refusals: list[str] = []
    insert = text("insert into documents values (:t, :b)")  # larger than SQLite's page cache: written
    document = b"\x01" * 3_000_000                          # out during the statement, refused there

    if shape == "sync":
        @app.handler("documents", token="body.id")
        def store_document(msg, tx):
            try:
                tx.execute(insert, {"t": msg.body["id"], "b": document})
            except Exception as exc:
                refusals.append(str(exc))
                raise
    elif shape == "async":
        @app.handler("documents", token="body.id")
        async def store_document(msg, tx):
            try:
                await tx.execute(insert, {"t": msg.body["id"], "b": document})
            except Exception as exc:
                refusals.append(str(exc))
                raise
    else:
        @app.handler("documents", token="body.id", batch=10)
        def store_document(messages, tx):
            try:
                tx.execute(insert, [{"t": msg.body["id"], "b": document} for msg in messages])
            except Exception as exc:
                refusals.append(str(exc))
                raise

    try:
        app.publish("documents", {"id": "d1"})
        clock.fill(small_disk)
        assert clock.ballast is not None and clock.ballast.hit_enospc
        clock.ballast.leave(ROOM)
        with capture_logs() as logs:
            app.run(until_idle=True)
        assert refusals and all("database or disk is full" in r for r in refusals[:3]), refusals[:3]
        assert [letter.failure.error_message[:60] for letter in app.dead_letters("store_document")] == []
        assert not clock.ballast.path.exists(), "space never came back"
        events = Counter(entry["event"] for entry in logs)
        assert events["message_deferred"] >= 3 and events["message_dead_lettered"] == 0, events
        with app.store.transaction() as tx:
            stored = tx.execute(text("select token, length(body) from documents")).all()
        assert [tuple(row) for row in stored] == [("d1", 3_000_000)]
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        app.close()


def test_publishing_on_a_full_disk_raises_an_error_naming_the_disk(small_disk: Path) -> None:
    broker_dir = small_disk / "broker"
    app = test_app(small_disk, clock=FakeClock(), transport=f"embedded://{broker_dir}",
                   settings={"RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "5"})
    try:
        app.publish("orders", {"id": 1})
        ballast = fill(small_disk)
        assert ballast.hit_enospc
        for topic in ("orders", "invoices"):  # a topic the broker has, and one it must first record
            with capture_logs() as logs, pytest.raises(DiskFullError, match="full") as raised:
                app.publish(topic, {"id": 2})
            assert str(broker_dir) in str(raised.value), raised.value
            assert [e["event"] for e in logs].count("publish_retried") > 1  # an outage: retried, then raised
        ballast.free()
        app.publish("invoices", {"id": 3})  # space is back: no restart needed
    finally:
        app.close()


def test_the_cli_on_a_full_disk_says_the_disk_is_full(small_disk: Path) -> None:
    app = test_app(small_disk, clock=FakeClock(), transport=f"embedded://{small_disk / 'broker'}")

    @app.handler("orders", token="body.id")
    def order(msg, tx):
        tx.publish("shipped", {"id": msg.body["id"]})
        raise TypeError("a bug: dead-lettered at once")

    app.publish("orders", {"id": 1})
    app.run(until_idle=True)
    assert len(app.dead_letters("order")) == 1
    app.close()
    ballast = fill(small_disk)
    assert ballast.hit_enospc
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")},
           "RELIABLE_STORE__URL": f"sqlite:///{small_disk / 'store.db'}",
           "RELIABLE_TRANSPORT__URL": f"embedded://{small_disk / 'broker'}"}
    try:
        for command in (["dlq", "list", "order"], ["outbox", "status"]):
            done = subprocess.run([reliable_exe(), *command], env=env, capture_output=True, text=True, timeout=60)
            said = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("{"))
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert f"the disk holding {small_disk} is full" in said, said
    finally:
        ballast.free()


def test_a_worker_whose_log_file_is_on_the_full_disk_goes_on(small_disk: Path) -> None:
    log_file = small_disk / "worker.log"
    with open(log_file, "w") as log:  # as `reliable run app:app 2>> worker.log` would
        done = subprocess.run([sys.executable, "-m", "tests.framework.full_disk_worker", str(small_disk)],
                              stdout=subprocess.PIPE, stderr=log, text=True, timeout=120,
                              cwd=Path(__file__).parents[2])
    written = log_file.read_text()
    assert done.returncode == 0, written[-3000:]  # before: run() raised OSError ENOSPC from a log call
    assert done.stdout.split() == ["effects", *sorted(f"order-{n}" for n in range(10))]
    assert '"event": "log_write_failed"' in written  # the disk really refused the log, and it says so


def test_a_second_process_on_the_embedded_broker_waits_out_a_full_disk(small_disk: Path, tmp_path: Path) -> None:
    clock = SpaceComesBack()  # one clock for both processes' time, as the wall clock would be
    owner = embedded_app(small_disk, clock)  # owns the broker's directory (and its local socket)
    owner.publish("warm-up", {"id": 0})
    # its client, with a store of its own on a disk with room: only the broker's disk is full
    other = test_app(tmp_path, clock=clock, transport=f"embedded://{small_disk / 'broker'}")
    create_effects(other, "effects")

    @other.handler("orders", token="body.id", group="billing")
    def bill(msg, tx):
        if msg.attempt == 1:
            raise TimeoutError("a service the handler calls timed out")
        tx.execute(text("insert into effects (token, attempt) values (:t, :a)"), {"t": "billed-1", "a": msg.attempt})

    try:
        other.publish("orders", {"id": 1, "lines": "x" * 256 * 1024})  # through the owner; group billing declared
        clock.fill(small_disk)
        assert clock.ballast is not None and clock.ballast.hit_enospc
        with capture_logs() as logs:
            other.run(until_idle=True)  # the retry's copy of 256 KiB: refused by the owner's full disk
        refusals = [e["error"] for e in logs if e["event"] == "transport_disk_full"]
        assert refusals and "full" in refusals[0], refusals[:1]
        assert effects(other) == ["billed-1"], Counter(e["event"] for e in logs)
    finally:
        if clock.ballast is not None:
            clock.ballast.free()
        other.close()
        owner.close()
