"""What a NATS server does to a running ``nats://`` worker and to ``app.publish``: JetStream's
stream, the group's durable consumer or its dead-letter stream deleted under them.

The old code: a consumer deleted made the worker's pulls wait in vain and ``app.run`` end with
"consumer not found" (a crash) at its next count; a stream deleted made every publish go
unanswered, taken for an outage and retried until ``publish_timeout`` (the transport never
created it again); a dead-letter stream deleted made every dead letter an outage, for ever.
Real NATS JetStream (the shared server: only streams of the test's own namespace are deleted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
from structlog.testing import capture_logs

from backends.transport.nats_layout import Layout
from backends.transport.nats_transport import NatsTransport
from reliable import App, Message
from reliable.settings import Settings
from tests.framework.refusals import Running
from tests.waiting import wait_until


class Poison(Exception):
    pass


def worker_app(folder: Path, url: str, done: list[int]) -> App:
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{folder / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": url,
                                       "RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "5"}))

    @app.handler("orders", group="shipping", fatal=[Poison])
    def ship(msg: Message, tx: object) -> None:
        if msg.body.get("poison"):
            raise Poison("never")
        done.append(msg.body["n"])

    return app


@pytest.fixture
def place(nats_url: str, unique: str) -> Iterator[str]:
    """A namespace of the test's own on the shared server; its streams deleted afterwards."""
    yield f"{nats_url}?namespace={unique}"
    with NatsTransport(nats_url, namespace=unique) as transport:
        transport.purge()


def delete(nats_url: str, stream: str, consumer: str | None = None) -> None:
    """Delete ``stream`` (or its ``consumer``) as an operator would, from a client of its own."""
    async def run() -> None:
        client = await nats.connect(nats_url)
        try:
            js = client.jetstream()
            await (js.delete_consumer(stream, consumer) if consumer else js.delete_stream(stream))
        finally:
            await client.close()

    asyncio.run(run())


def nothing_unacked(nats_url: str, stream: str, consumer: str) -> bool:
    """Whether ``consumer`` has every message it handed out acknowledged."""
    async def run() -> bool:
        client = await nats.connect(nats_url)
        try:
            return (await client.jetstream().consumer_info(stream, consumer)).num_ack_pending == 0
        finally:
            await client.close()

    return asyncio.run(run())


def stream_exists(nats_url: str, stream: str) -> bool:
    async def run() -> bool:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().stream_info(stream)
            return True
        except nats.js.errors.NotFoundError:
            return False
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("deleted", ["consumer", "stream"])
def test_a_worker_whose_consumer_or_stream_is_deleted_joins_again_and_goes_on(
    tmp_path: Path, nats_url: str, place: str, unique: str, deleted: str
) -> None:
    done: list[int] = []
    app = worker_app(tmp_path, place, done)
    stream = Layout(unique).stream("orders")
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1], "the first message handled")
        wait_until(lambda: nothing_unacked(nats_url, stream, Layout.consumers("shipping")[0]),
                   "the first message acknowledged")  # else its ack meets the deletion
        delete(nats_url, stream, Layout.consumers("shipping")[0] if deleted == "consumer" else None)
        wait_until(lambda: any(e["event"] == "transport_unavailable" for e in logs) or run.error,
                   "the worker to notice")
        app.publish("orders", {"n": 2})  # the stream deleted: created again, not an outage
        wait_until(lambda: 2 in done or run.error, "the message published after the deletion handled")
        app.stop()
        run.join()
    assert run.error is None, run.error  # the old code: TransportError "consumer not found"
    assert done == [1, 2]  # 1 read again by the new consumer: skipped by its token
    (left,) = [e for e in logs if e["event"] == "transport_unavailable"]
    assert f"the {deleted} was deleted from JetStream (stream {stream!r}" in left["error"]
    # said once, not when first made (the old worker re-read the stream in silence): the deleted
    # consumer, or both of the group's when their stream went
    recreated = [e for e in logs if e["event"] == "transport.group_recreated"]
    assert {e["consumer"] for e in recreated} == (
        {Layout.consumers("shipping")[0]} if deleted == "consumer" else set(Layout.consumers("shipping")))
    assert all((e["group"], e["topic"], e["log_level"]) == ("shipping", "orders", "warning") for e in recreated)
    assert all(e["offset"] == 1 for e in recreated)  # the stream's first sequence: its start
    app.close()


def test_a_dead_letter_stream_deleted_is_created_again_when_the_group_joins(tmp_path: Path, nats_url: str, place: str,
                                                       unique: str) -> None:
    done: list[int] = []
    app = worker_app(tmp_path, place, done)
    dead_letters = Layout(unique).dead_letter_stream("shipping")
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1], "the first message handled")
        delete(nats_url, dead_letters)
        app.publish("orders", {"n": 2, "poison": True})
        app.publish("orders", {"n": 3})
        wait_until(lambda: 3 in done or run.error, "the message after the poison one handled")
        # for the next dead letter; this one's record is the store's
        wait_until(lambda: stream_exists(nats_url, dead_letters) or run.error, "the dead-letter stream created again")
        app.stop()
        run.join()
    assert run.error is None, run.error
    (left,) = [e for e in logs if e["event"] == "transport_unavailable"]  # the old code: one per try
    assert f"the stream was deleted from JetStream (stream {dead_letters!r}" in left["error"]
    app.close()
