"""The transactional outbox: ``tx.publish`` commits or rolls back with the handler, the relay
sends each committed row once, with the row's message id, in order per key.

Everything runs on real components: the embedded broker, SQLite files and
the shared PostgreSQL (each test in an outbox of its own name).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from backends.errors import OutboxMessageError
from backends.store.outbox import RowState
from backends.transport.base import Transport
from backends.types import Message, OutgoingMessage, text_from_bytes
from reliable import App
from reliable.outbox import QUICK_PASS, Relay
from reliable.settings import Settings
from reliable.testing import FakeClock, test_app
from tests.framework.conftest import create_effects, effects, write_effect
from tests.transports.effects import wait_until


@pytest.fixture
def app(tmp_path: Path, store_url: str, unique: str) -> Iterator[App]:
    app = test_app(tmp_path, store=store_url, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_OUTBOX__NAME": unique, "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    create_effects(app, f"{unique}_effects")
    yield app
    with app.store.transaction() as tx:
        tx.execute(text(f"drop table if exists {unique}_effects"))
    app.close()


def received(app: App, group: str, topic: str, count: int) -> list[Message]:
    """Everything ``group`` gets of ``topic`` once ``count`` arrived (acked as it comes)."""
    got: list[Message] = []
    with app.transport.subscribe(group, [topic]) as subscription:
        while len(got) < count:
            batch = subscription.fetch(count, timeout=5.0)
            assert batch, f"only {len(got)} of {count} messages arrived"
            subscription.ack(batch)
            got += batch
        assert subscription.fetch(count, timeout=0.2) == []
    return got


def test_a_handler_that_publishes_reaches_the_next_handler_once(app: App, unique: str) -> None:
    table = f"{unique}_effects"

    @app.handler("orders", group=f"{unique}-orders", token="body.id")
    def order(msg: Message, tx) -> None:
        write_effect(tx, f"order-{msg.body['id']}", table=table)
        tx.publish("invoices", {"order": msg.body["id"]}, key=str(msg.body["id"]))

    @app.handler("invoices", group=f"{unique}-invoices", token="id")
    def invoice(msg: Message, tx) -> None:
        write_effect(tx, f"invoice-{msg.body['order']}", table=table)

    for n in (1, 2, 1):  # a duplicate: its follow-up is not written twice
        app.publish("orders", {"id": n})
    app.run(until_idle=True)

    assert effects(app, table) == ["invoice-1", "invoice-2", "order-1", "order-2"]
    status = app.store.outbox.status()
    assert (status.backlog, status.sent, status.failed) == (0, 2, 0)


def test_a_handler_that_raises_after_publishing_publishes_nothing(app: App, unique: str) -> None:
    @app.handler("orders", group=f"{unique}-orders", fatal=[ValueError])
    def order(msg: Message, tx) -> None:
        tx.publish("invoices", {"order": 1})
        raise ValueError("the order is invalid")

    app.transport.declare(f"{unique}-invoices", ["invoices"])
    app.publish("orders", {"id": 1})
    app.run(until_idle=True)

    assert app.stats()["dead_lettered"] == 1
    assert app.store.outbox.rows() == []
    with app.transport.subscribe(f"{unique}-invoices", ["invoices"]) as subscription:
        assert subscription.fetch(10, timeout=0.2) == []


def test_a_batch_handler_isolating_a_poison_message_keeps_its_neighbours_publishes(app: App, unique: str) -> None:
    @app.handler("orders", group=f"{unique}-orders", token="body.id", batch=10, fatal=[ValueError])
    def orders(messages: list[Message], tx) -> None:
        for msg in messages:
            tx.publish("invoices", {"order": msg.body["id"]})
            if msg.body["id"] == 3:
                raise ValueError("poison")

    for n in range(1, 6):
        app.publish("orders", {"id": n})
    app.run(until_idle=True)

    bodies = sorted(m.body["order"] for m in received(app, f"{unique}-invoices", "invoices", 4))
    assert bodies == [1, 2, 4, 5]


def test_plain_code_publishes_with_its_own_writes_and_the_row_id_travels(app: App, unique: str) -> None:
    with app.store.transaction() as tx:
        write_effect(tx, "web-request", table=f"{unique}_effects")
        message_id = tx.publish("signups", {"user": 7}, key="user-7", headers={"origin": "web"})
    with pytest.raises(RuntimeError), app.store.transaction() as tx:
        tx.publish("signups", {"user": 8})
        raise RuntimeError("the request failed")
    app.transport.declare(f"{unique}-signups", ["signups"])

    assert app.relay().drain()

    [message] = received(app, f"{unique}-signups", "signups", 1)
    assert (message.id, message.key, message.body) == (message_id, "user-7", {"user": 7})
    assert message.headers["origin"] == "web"
    [row] = app.store.outbox.rows()
    assert (row.message_id, row.state) == (message_id, RowState.SENT)


def test_bad_messages_are_refused_before_anything_is_written(app: App, unique: str) -> None:
    bad: list[dict[str, object]] = [
        {"topic": ""}, {"topic": "%DLQ%x"}, {"key": 5}, {"headers": {"a": 1}}, {"delay": -1},
        {"delay": float("nan")}, {"body": object()},
        # what PostgreSQL's columns refuse at the commit (and SQLite stores): refused here on both
        {"topic": "t\x00"}, {"topic": "t" * 256}, {"key": "k\x00"}, {"key": "k" * 513},
        {"message_id": "m\x00"},
        # a binary Kafka key passed on (bytes that are not UTF-8): no store's text column holds it
        {"key": text_from_bytes(b"\x80")}, {"topic": text_from_bytes(b"t\xff")}, {"message_id": text_from_bytes(b"\xfe")},
        # a header name no transport carries (librdkafka crashed the relay's process on it)
        {"headers": {text_from_bytes(b"h\xff"): "v"}},
    ]
    with app.store.transaction() as tx:
        for fields in bad:
            call = {"topic": "t", "body": {"ok": 1}, **fields}
            with pytest.raises(OutboxMessageError, match="tx.publish to"):
                tx.publish(call.pop("topic"), call.pop("body"), **call)  # type: ignore[arg-type]
    assert app.store.outbox.rows() == []


class Wrapping(Transport):
    """A real transport (``inner``) whose publishes a subclass watches (its `_send`)."""

    inner: Transport

    def subscribe(self, group, topics, options=None):  # type: ignore[no-untyped-def]
        return self.inner.subscribe(group, topics, options)

    def _send_to_group(self, group, topic, messages):  # type: ignore[no-untyped-def]
        self.inner.publish_to_group(group, topic, messages)

    def close(self) -> None:
        self.inner.close()


class Recording(Wrapping):
    """A real transport, with every confirmed publish recorded by the relay that made it.

    With ``meet``, each relay's first publish waits (holding its claimed rows) until the other
    relay publishes too: it can only if it claimed other rows meanwhile.
    """

    def __init__(self, inner: Transport, sends: list[tuple[str, str]], lock: threading.Lock,
                 in_flight: list[int], overlaps: list[int], meet: threading.Barrier | None) -> None:
        self.inner, self.sends, self.lock = inner, sends, lock
        self.in_flight, self.overlaps, self.meet = in_flight, overlaps, meet
        self.capabilities = inner.capabilities

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        with self.lock:
            self.in_flight[0] += 1
            self.overlaps[0] = max(self.overlaps[0], self.in_flight[0])
        try:
            if self.meet is not None:
                meet, self.meet = self.meet, None
                try:
                    meet.wait(timeout=20)
                except threading.BrokenBarrierError:
                    pass  # the other relay never published meanwhile: overlaps stays 1
            self.inner.publish(topic, messages)
        finally:
            with self.lock:
                self.in_flight[0] -= 1
                self.sends += [(threading.current_thread().name, m.message_id or "") for m in messages]


def test_two_relays_over_one_outbox_never_send_a_row_twice_and_keep_key_order(
    app: App, unique: str, store_url: str
) -> None:
    rows, keys = 3000, 30
    for start in range(0, rows, 500):
        with app.store.transaction() as tx:
            for n in range(start, start + 500):  # one row in three without a key: any relay may send it
                tx.publish("ledger", {"n": n}, key=f"k{n % keys}" if n % 3 else None)
    app.transport.declare(f"{unique}-ledger", ["ledger"])
    settings = Settings.load(None, env={"RELIABLE_OUTBOX__NAME": unique, "RELIABLE_OUTBOX__BATCH_SIZE": "40"})
    sends: list[tuple[str, str]] = []
    lock, in_flight, overlaps = threading.Lock(), [0], [0]
    meet = threading.Barrier(2) if store_url.startswith("postgresql") else None  # SQLite: one writer
    relays = []
    for _ in range(2):  # each relay on its own store: its own connections, as in two processes
        store = type(app.store)(store_url, app.clock, outbox=unique)
        recording = Recording(app.transport, sends, lock, in_flight, overlaps, meet)
        relays.append((store, Relay(store, recording, settings.outbox, app.clock)))
    start = threading.Barrier(2)

    def drain(relay: Relay) -> None:
        start.wait()
        while relay.outbox.status().backlog:
            relay.drain()

    threads = [threading.Thread(target=drain, args=(relay,), name=f"relay-{i}") for i, (_, relay) in enumerate(relays)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for store, _ in relays:
        store.close()

    ids = [message_id for _, message_id in sends]
    assert len(ids) == len(set(ids)) == rows  # no row sent twice, none left out
    if meet is not None:  # on PostgreSQL both took rows and published at the same time, holding other rows
        assert {name for name, _ in sends} == {"relay-0", "relay-1"}
        assert overlaps[0] == 2
    # (on SQLite the relays take turns at the database's one write lock, in no fair order)
    got = received(app, f"{unique}-ledger", "ledger", rows)
    per_key: dict[str | None, list[int]] = {}
    for m in got:
        per_key.setdefault(m.key, []).append(m.body["n"])
    assert all(ns == sorted(ns) for key, ns in per_key.items() if key is not None)  # no order without a key
    assert sum(map(len, per_key.values())) == rows


def test_test_app_runs_the_relay(tmp_path: Path) -> None:
    app = test_app(tmp_path)
    seen: list[int] = []

    @app.handler("orders")
    def order(msg: Message, tx) -> None:
        tx.publish("shipments", {"order": msg.body["id"]}, delay=30)

    @app.handler("shipments")
    def shipment(msg: Message) -> None:
        seen.append(msg.body["order"])

    app.publish("orders", {"id": 1})
    app.run(until_idle=True)  # the delay passes on the fake clock
    assert seen == [1]
    app.close()


def test_a_lease_handler_publishes_with_its_stored_result_and_not_when_it_fails(app: App, unique: str) -> None:
    @app.handler("emails", group=f"{unique}-emails", token="body.id", lease=30.0, fatal=[ValueError])
    def send(msg: Message, tx) -> str:
        tx.publish("sent", {"email": msg.body["id"]}, key=str(msg.body["id"]))
        if msg.body["id"] == 2:
            raise ValueError("the address bounced")
        return "delivered"

    for n in (1, 2, 1):  # the duplicate gets the stored result and publishes nothing
        app.publish("emails", {"id": n})
    app.run(until_idle=True)

    [message] = received(app, f"{unique}-sent", "sent", 1)
    assert message.body == {"email": 1}
    [row] = app.store.outbox.rows()
    assert row.message_id == message.id
    with pytest.raises(OutboxMessageError, match="message_id"), app.store.transaction() as tx:
        tx.publish("sent", {}, message_id="x" * 65)


def test_a_lease_handler_retried_in_process_publishes_only_what_its_last_attempt_did(
    app: App, unique: str
) -> None:
    """Each attempt is a fresh ``tx``: what an attempt that raised published goes with it, as a
    rolled-back transaction's rows do in the other modes."""
    attempts: list[int] = []

    @app.handler("emails", group=f"{unique}-emails", token="body.id", lease=30.0, in_process=3)
    def send(msg: Message, tx) -> str:
        attempts.append(len(attempts) + 1)
        tx.publish("sent", {"attempt": attempts[-1]}, key="k")
        if len(attempts) < 3:
            raise ConnectionError("the mail server hung up")
        return "delivered"

    app.publish("emails", {"id": 1})
    app.run(until_idle=True)

    assert attempts == [1, 2, 3] and app.stats()["redelivered"] == 0
    [message] = received(app, f"{unique}-sent", "sent", 1)
    assert message.body == {"attempt": 3}
    assert [row.message_id for row in app.store.outbox.rows()] == [message.id]


def test_a_publish_after_its_transaction_ended_raises_instead_of_vanishing(app: App, unique: str) -> None:
    """A ``tx`` kept past its end (a handler's, sync, async or lease; plain code's, committed or
    rolled back) refuses ``publish``: it used to hand back a message id and write nothing."""
    kept: list[object] = []

    @app.handler("orders", group=f"{unique}-orders", token="body.id")
    def order(msg: Message, tx) -> None:
        kept.append(tx)

    @app.handler("emails", group=f"{unique}-emails", token="body.id", lease=30.0)
    def email(msg: Message, tx) -> str:
        kept.append(tx)
        return "sent"

    @app.handler("shipments", group=f"{unique}-shipments", token="body.id")
    async def ship(msg: Message, tx) -> None:
        kept.append(tx)

    for topic in ("orders", "emails", "shipments"):
        app.publish(topic, {"id": 1})
    app.run(until_idle=True)
    with app.store.transaction() as committed:
        pass
    with pytest.raises(RuntimeError), app.store.transaction() as rolled_back:
        raise RuntimeError("rolled back")

    assert len(kept) == 3
    for tx in [*kept, committed, rolled_back]:
        with pytest.raises(OutboxMessageError, match="tx.publish to 'late' after its transaction ended"):
            tx.publish("late", {"n": 1})  # type: ignore[attr-defined]
    assert app.store.outbox.rows() == []


def test_an_async_handler_publishes_through_its_async_transaction(app: App, unique: str) -> None:
    @app.handler("orders", group=f"{unique}-orders", token="body.id")
    async def order(msg: Message, tx) -> None:
        tx.publish("invoices", {"order": msg.body["id"]}, key="k")
        if msg.body["id"] == 2:
            raise ValueError("rolled back with its publish")

    for n in (1, 2):
        app.publish("orders", {"id": n})
    app.run(until_idle=True)

    [message] = received(app, f"{unique}-invoices", "invoices", 1)
    assert message.body == {"order": 1}


def test_a_running_relay_purges_sent_rows_past_the_retention_and_reports_the_backlog(
    tmp_path: Path, unique: str
) -> None:
    clock = FakeClock()
    app = test_app(tmp_path, clock=clock, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_OUTBOX__NAME": unique, "RELIABLE_OUTBOX__RETENTION": "1h"})
    with app.store.transaction() as tx:
        tx.publish("orders", "x" * 5_000_000, key="k")  # above max_record_size: FAILED, the oldest unsent row
        tx.publish("orders", {"n": 1})
    app.relay().drain()
    clock.advance(2 * 3600)  # the sent row is past the retention
    with app.store.transaction() as tx:
        tx.publish("orders", {"n": 2})  # sent now: within the retention
    labels = {"outbox": unique}
    with app.relay().running():
        wait_until(lambda: [r.state for r in app.store.outbox.rows()] == [RowState.FAILED, RowState.SENT]
                   and REGISTRY.get_sample_value("reliable_outbox_backlog", labels) == 0, every=0.05)
    assert REGISTRY.get_sample_value("reliable_outbox_oldest_unsent_seconds", labels) == 2 * 3600
    assert REGISTRY.get_sample_value("reliable_outbox_rows_total", {**labels, "state": "failed"}) == 1
    assert REGISTRY.get_sample_value("reliable_outbox_rows_total", {**labels, "state": "sent"}) == 2
    app.close()


class Timed(Wrapping):
    """A real transport whose every publish is recorded and takes ``each`` seconds of ``clock``."""

    def __init__(self, inner: Transport, clock: FakeClock, each: float) -> None:
        self.inner, self.clock, self.each = inner, clock, each
        self.capabilities = inner.capabilities
        self.sends: list[list[OutgoingMessage]] = []

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        self.inner.publish(topic, messages)
        self.sends.append(list(messages))
        self.clock.advance(self.each)


@pytest.mark.parametrize("each", [0.0, QUICK_PASS], ids=["quick", "slow"])
def test_a_backlog_grows_the_passes_while_they_are_quick_and_sends_batches_of_batch_size(
    app: App, unique: str, each: float
) -> None:
    for start in range(0, 3150, 525):
        with app.store.transaction() as tx:
            for n in range(start, start + 525):
                tx.publish("ledger", {"n": n}, key=f"k{n % 7}")
    settings = Settings.load(None, env={"RELIABLE_OUTBOX__NAME": unique, "RELIABLE_OUTBOX__BATCH_SIZE": "100"})
    clock = FakeClock()
    timed = Timed(app.transport, clock, each)
    relay = Relay(app.store, timed, settings.outbox, clock)
    passes = []
    while settled := relay.step():
        passes.append(settled)
    if each:  # a pass that takes the time a quick one may hold the database: no growth
        assert passes == [100] * 31 + [50]
    else:  # each full, quick pass claims twice the rows of the last one
        assert passes == [100, 200, 400, 800, 1600, 50]
    assert {len(batch) for batch in timed.sends} <= {100, 50}  # the direct publish's batches, however large the pass
    assert [m.payload for batch in timed.sends for m in batch] == [f'{{"n":{n}}}'.encode() for n in range(3150)]
    with app.store.transaction() as tx:  # the backlog sent: the next pass is batch_size again
        for n in range(150):
            tx.publish("ledger", {"n": n})
    assert relay.step() == 100
