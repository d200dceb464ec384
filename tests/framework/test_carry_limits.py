"""A message that fits a transport's wire while its copies do not: a redelivery the transport makes
by copying the message with headers of its own (a Kafka retry topic; the broker's ``%RETRY%<group>``
record until it kept room for them) grows past the limit its original was just under.

Real engines: the broker in process (``embedded://``, ``max_record_size``), the broker server
(``reliable://``) and the mock Kafka cluster (the producer's ``message.max.bytes``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from backends.errors import OutboxMessageError, TransportError
from backends.store.outbox import RowState
from backends.transport.base import Transport
from backends.types import OutgoingMessage
from reliable import App
from reliable.outbox import Relay
from reliable.settings import Settings
from tests.framework.refusals import Running
from tests.waiting import wait_until


class Flaky(Exception):
    """A failure worth another try."""


def closed(app: App) -> None:
    """Close ``app``, first deleting what its transport keeps under the test's namespace (the
    queues and streams of RabbitMQ, NATS and Redis, which the servers would keep)."""
    purge = getattr(app.transport, "purge", None)
    if purge is not None:
        purge()
    app.close()


def largest_accepted(app: App, topic: str, low: int, high: int, padded: Padded | None = None) -> int:
    """The largest body (or ``padded`` field) ``app.publish`` gets through to ``topic`` (key ``big``),
    by bisection, less 32 bytes: the time a message carries (``repr`` of a float) varies in length."""
    while high - low > 1:
        middle = (low + high) // 2
        try:
            app.publish(topic, **(padded or in_body)(middle))
        except TransportError:
            high = middle
        else:
            low = middle
    return low - 32


Padded = Callable[[int], dict[str, Any]]
"""The fields of ``app.publish`` for a message padded to a size."""


def in_body(size: int) -> dict[str, Any]:
    return {"body": b"x" * size, "key": "big"}


def in_header(size: int) -> dict[str, Any]:  # AMQP's headers travel in one frame of frame_max bytes
    return {"body": b"", "key": "big", "headers": {"pad": "x" * size}}


@pytest.mark.parametrize("engine", ["kafka", "kafka-async", "amqp", "embedded", "reliable"])
def test_the_largest_message_is_retried_or_dead_lettered_saying_why_not(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> None:
    """The largest message the transport takes fails in its handler, worth another try. On Kafka
    its retry copy is refused for good: the worker ended with that `TransportError` (and met it
    again at every restart); now the message is dead-lettered with the refusal in its failure, and
    the worker goes on with its neighbour, retried and dead-lettered as usual (sync and ``async def``
    handlers). The broker (``embedded://``, ``reliable://``) refused its ``%RETRY%`` copy the
    same way; it now keeps room for the copy's headers, so the message is retried like any other."""
    refused, padded = engine.startswith(("kafka", "amqp")), in_header if engine == "amqp" else in_body
    url, low, high = (request.getfixturevalue("kafka_url"), 990_000, 1_000_000) if engine.startswith("kafka") else (
        f"{request.getfixturevalue('amqp_url')}?namespace={unique}", 120_000, 131_072) if engine == "amqp" else (
        request.getfixturevalue("reliable_server").url if engine == "reliable" else f"embedded://{tmp_path / 'b'}",
        4_000_000, 4_194_304)  # max_record_size
    app = App(Settings.load(None, env={
        "RELIABLE_TRANSPORT__URL": url, "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.1", "RELIABLE_RETRY__MAX_REDELIVERIES": "1"}))
    topic, group = f"{unique}a", f"g{uuid.uuid4().hex[:12]}"

    def fail(msg, tx):
        raise Flaky(f"{len(msg.headers.get('pad', msg.payload))} bytes")

    async def fail_async(msg, tx):
        fail(msg, tx)

    app.handler(topic, group=group, retry_on=[Flaky], token=lambda msg: msg.id)(
        fail_async if engine.endswith("async") else fail)

    @app.handler(f"{unique}b", group=f"probe{group}")  # amqp:// keeps only what a group takes
    def probed(msg, tx):
        pass

    size = largest_accepted(app, f"{unique}b", low, high, padded)  # a topic name as long: the same size
    app.publish(topic, **padded(size))
    app.publish(topic, b"small", key="small")
    run = Running(app)  # not until idle: a Kafka member cannot tell it is (no `drain`)
    try:
        wait_until(lambda: not run.thread.is_alive() or len(app.dead_letters(group)) == 2,
                   "both messages dead-lettered, or the worker ended")
        app.stop()
        run.join()
        assert run.error is None, run.error
        letters = {letter.message.key: letter.failure for letter in app.dead_letters(group)}
        assert sorted(letters) == ["big", "small"]
        if refused:
            assert letters["big"].error_message.startswith(
                f"{size} bytes [not redelivered: the transport refused its retry copy: ")
            assert letters["big"].attempts == 1
        else:
            assert (letters["big"].error_message, letters["big"].attempts) == (f"{size} bytes", 2)
        assert letters["small"].error_message == "5 bytes"
        assert letters["small"].attempts == 2
    finally:
        closed(app)


OUTBOX_PLACES = {  # a URL on the engine, and a row it refuses for good (the body, or one header)
    "embedded": (lambda request, tmp_path, unique: f"embedded://{tmp_path / 'broker'}", {"body": "x" * 5_000_000}),
    "reliable": (lambda request, tmp_path, unique: request.getfixturevalue("reliable_server").url,
                 {"body": "x" * 5_000_000}),
    "kafka": (lambda request, tmp_path, unique: request.getfixturevalue("kafka_url"), {"body": "x" * 2_000_000}),
    "nats": (lambda request, tmp_path, unique: f"{request.getfixturevalue('nats_url')}?namespace={unique}",
             {"body": "x" * 2_000_000}),
    "amqp": (lambda request, tmp_path, unique: f"{request.getfixturevalue('amqp_url')}?namespace={unique}",
             {"headers": {"big": "x" * 200_000}}),  # above the connection's frame_max
}


@pytest.mark.parametrize("engine", sorted(OUTBOX_PLACES))
def test_the_relay_marks_a_row_the_transport_refuses_failed_and_sends_the_rest(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> None:
    """A row too large for the wire is marked failed with the transport's reason, counted in
    `status`; the rows of other keys and without a key are sent; the later row of its key waits
    behind it (per-key order) until ``reliable outbox retry``, which puts it back in line."""
    place, big = OUTBOX_PLACES[engine]
    app = App(Settings.load(None, env={"RELIABLE_TRANSPORT__URL": place(request, tmp_path, unique),
                                       "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}"}))
    topic, got = f"{unique}o", []

    @app.handler(topic, group=f"g{unique}")  # amqp:// keeps messages only for the groups it knows
    def take(msg, tx):
        got.append(msg.body["n"])

    with app.store.transaction() as tx:
        tx.publish(topic, {"n": 1}, key="a")
        tx.publish(topic, big.get("body", {"n": 0}), key="big", headers=big.get("headers"))
        tx.publish(topic, {"n": 2}, key="big")
        tx.publish(topic, {"n": 3}, key="c")
        tx.publish(topic, {"n": 4})
    relay = app.relay()
    relay.drain()
    outbox = app.store.outbox
    (failed,) = outbox.rows(RowState.FAILED)
    assert failed.key == "big"
    assert re.search(r"max|frame|large", failed.error or ""), failed.error
    assert [row.key for row in outbox.rows(RowState.PENDING)] == ["big"]
    status = outbox.status()
    assert (status.backlog, status.failed, status.sent) == (1, 1, 3)
    run = Running(app)
    try:
        wait_until(lambda: sorted(got) == [1, 3, 4], "the rows of other keys handled")
        assert outbox.retry() == [failed.id]  # failed again (the wire has not changed), then held again
        relay.drain()
        assert [row.key for row in outbox.rows(RowState.PENDING)] == ["big"]
        assert [row.id for row in outbox.rows(RowState.FAILED)] == [failed.id]
    finally:
        app.stop()
        run.join()
        closed(app)
    assert run.error is None, run.error


@pytest.mark.parametrize("engine", ["embedded", "kafka"])
def test_a_dead_letter_whose_copy_is_refused_keeps_its_whole_record(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> None:
    """The largest message the transport takes is poison: Kafka's dead-letter copy (the failure in
    its headers, cut short) is refused for the headers it adds; the store's record keeps the
    whole failure, the copy's refusal is logged, and the worker goes on. (``embedded://`` writes
    no copy at all.)"""
    url, low, high = {
        "embedded": (f"embedded://{tmp_path / 'broker'}", 4_000_000, 4_194_304),
        "kafka": (request.getfixturevalue("kafka_url") if engine == "kafka" else "", 990_000, 1_000_000),
    }[engine]
    app = App(Settings.load(None, env={"RELIABLE_TRANSPORT__URL": url,
                                       "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}"}))
    topic, group = f"{unique}a", f"g{uuid.uuid4().hex[:12]}"

    @app.handler(topic, group=group, retry_on=[Flaky], token=lambda msg: msg.id)
    def poison(msg, tx):
        raise ValueError(f"{len(msg.payload)} bytes: " + "why " * 5_000)

    size = largest_accepted(app, f"{unique}b", low, high)
    app.publish(topic, b"x" * size, key="big")
    app.publish(topic, b"small", key="small")
    with capture_logs() as logs:
        run = Running(app)
        try:
            wait_until(lambda: not run.thread.is_alive() or len(app.dead_letters(group)) == 2,
                       "both messages dead-lettered, or the worker ended")
        finally:
            app.stop()
            run.join()
    try:
        assert run.error is None, run.error
        letters = {letter.message.key: letter.failure for letter in app.dead_letters(group)}
        assert letters["big"].error_message == f"{size} bytes: " + "why " * 5_000  # whole, not cut
        assert len(letters["big"].error_message) > 20_000
        refused = [log for log in logs if log["event"] == "dead_letter_copy_refused"]
        assert len(refused) == (1 if engine == "kafka" else 0)
    finally:
        closed(app)


@pytest.mark.parametrize("engine", ["embedded", "nats", "amqp", "kafka", "redis"])
def test_tx_publish_refuses_a_topic_the_transport_never_takes(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> None:
    """A topic name the transport refuses ('a b') was written to the outbox and marked failed by
    the relay, every later row of its key held behind it; `tx.publish` now refuses it, naming the
    transport's rule, so the handler's transaction fails instead (lease mode too). Redis takes
    any name."""
    url = {"embedded": f"embedded://{tmp_path / 'b'}", "nats": f"{request.getfixturevalue('nats_url')}?namespace={unique}"
           if engine == "nats" else "", "amqp": f"{request.getfixturevalue('amqp_url')}?namespace={unique}"
           if engine == "amqp" else "", "kafka": request.getfixturevalue("kafka_url") if engine == "kafka" else "",
           "redis": f"{request.getfixturevalue('redis_url')}?namespace={unique}" if engine == "redis" else ""}[engine]
    app = App(Settings.load(None, env={"RELIABLE_TRANSPORT__URL": url,
                                       "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}"}))
    try:
        if engine == "redis":
            with app.store.transaction() as tx:
                tx.publish("a b", {"n": 1}, key="k")
            assert [row.topic for row in app.store.outbox.rows()] == ["a b"]
            return
        with app.store.transaction() as tx:
            with pytest.raises(OutboxMessageError, match=r"tx.publish to 'a b': topic name 'a b'"):
                tx.publish("a b", {"n": 1}, key="k")
            tx.publish(f"{unique}ok", {"n": 2}, key="k")
        assert [row.topic for row in app.store.outbox.rows()] == [f"{unique}ok"]
        if engine != "embedded":
            return
        topic, tried = f"{unique}in", []

        @app.handler(topic, group=f"g{unique}", lease=5.0, retry_on=[])
        def leased(msg, tx):
            tried.append(msg.id)
            tx.publish("a b", {"n": 3})

        app.publish(topic, {"n": 0})
        app.run(until_idle=True)
        (letter,) = app.dead_letters(f"g{unique}")
        assert "tx.publish to 'a b': topic name 'a b'" in letter.failure.error_message
        assert [row.topic for row in app.store.outbox.rows()] == [f"{unique}ok"]
    finally:
        closed(app)


class FailsOnOneMessage(Transport):
    """The broker in process behind a client that fails on a message with the header ``bug``, after
    sending the messages of the call before it, with an error of its own (neither a refusal nor an
    outage): what a client library's bug looks like to the relay."""

    def __init__(self, inner: Transport) -> None:
        self.inner, self.capabilities = inner, inner.capabilities

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        for message in messages:
            if "bug" in message.headers:
                raise UnicodeError("the client library failed on it")
            self.inner.publish(topic, [message])

    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        self.inner.publish_to_group(group, topic, messages)

    def subscribe(self, group, topics, options=None):  # type: ignore[no-untyped-def]
        return self.inner.subscribe(group, topics, options)

    def close(self) -> None:
        self.inner.close()


def test_a_row_the_client_library_fails_on_is_marked_failed_not_resent_for_ever(tmp_path: Path, unique: str) -> None:
    """The relay took such an error for neither a refusal nor an outage: each pass rolled back,
    the rows the transport had confirmed were sent again every ``poll_interval``, and no row after
    it ever left. Now the row is marked failed with the error, the rest are sent once."""
    app = App(Settings.load(None, env={"RELIABLE_TRANSPORT__URL": f"embedded://{tmp_path / 'b'}",
                                       "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}"}))
    try:
        with app.store.transaction() as tx:
            tx.publish("orders", {"n": 1}, key="a")
            tx.publish("orders", {"n": 2}, key="b", headers={"bug": "1"})
            tx.publish("orders", {"n": 3}, key="b")
            tx.publish("orders", {"n": 4}, key="c")
        member = app.transport.subscribe("g", ["orders"])
        relay = Relay(app.store, FailsOnOneMessage(app.transport), app.settings.outbox, app.clock)
        relay.drain()
        (failed,) = app.store.outbox.rows(RowState.FAILED)
        assert (failed.key, failed.error) == ("b", "UnicodeError: the client library failed on it")
        assert [row.key for row in app.store.outbox.rows(RowState.PENDING)] == ["b"]
        assert sorted(m.body["n"] for m in member.fetch(10, 5)) == [1, 4]
        member.close()
    finally:
        closed(app)
