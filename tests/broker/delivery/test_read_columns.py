"""Reading by position column by column (`read_columns`): the same messages as `read`, from the
engine, from the server's native client and over an embedded broker's local socket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker.client import Client
from broker.delivery.engine import Broker
from broker.delivery.values import DeliveryColumns, OutgoingMessage
from broker.local import LocalClient
from tests.broker.server.serving import ServerProcess


def mixed(count: int) -> list[OutgoingMessage]:
    """Messages whose keys, tags and headers differ from row to row, or not at all."""
    return [OutgoingMessage(f'{{"n":{n}}}'.encode(), key=f"k{n}" if n % 3 else "", tag="t" if n % 2 else "",
                            headers={"content-type": "application/json"} if n % 5 else {}, message_id=f"m{n}")
            for n in range(count)]


def same_everywhere(count: int) -> list[OutgoingMessage]:
    return [OutgoingMessage(b"x", message_id=f"s{n}", headers={"h": "v"}) for n in range(count)]


def check(reader: Broker | Client | LocalClient, engine: Broker, topic: str) -> None:
    for queue, (first, end) in enumerate(engine.queue_offsets(topic)):
        columns = reader.read_columns(topic, queue, first, end - first + 10)
        assert isinstance(columns, DeliveryColumns)
        expected = engine.read(topic, queue, first, end - first + 10)
        assert columns.count == len(expected) == end - first
        assert columns.deliveries() == expected
        assert list(columns.column("offset")) == list(range(first, end))
        later = reader.read_columns(topic, queue, first + 1, 2)  # a range inside the queue
        assert later.deliveries() == expected[1:3]
        assert reader.read_columns(topic, queue, end, 5).count == 0  # nothing past the end


@pytest.fixture
def engine(tmp_path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "broker")
    broker.publish("mixed", mixed(40))
    broker.publish("same", same_everywhere(12))
    yield broker
    broker.close()


def test_the_engine_reads_columns_as_it_reads_deliveries(engine) -> None:
    check(engine, engine, "mixed")
    check(engine, engine, "same")
    assert all(dict(h) == {"h": "v"} for q in range(4) for h in engine.read_columns("same", q, 0, 10).column("headers"))


def test_the_local_socket_carries_a_read_as_a_table(engine, tmp_path) -> None:
    from broker.local import LocalServer

    server = LocalServer(engine, tmp_path / "broker")
    client = LocalClient(tmp_path / "broker")
    try:
        check(client, engine, "mixed")
        check(client, engine, "same")
    finally:
        client.close()
        server.close()


def test_the_native_client_reads_columns_from_a_server(tmp_path) -> None:
    server = ServerProcess(tmp_path / "data").start()
    client = Client(server.url)
    try:
        client.publish("mixed", mixed(40))
        for queue, (first, end) in enumerate(client.queue_offsets("mixed")):
            columns = client.read_columns("mixed", queue, first, 100)
            assert columns.deliveries() == client.read("mixed", queue, first, 100)
            assert [d.message_id for d in columns.deliveries()] == [
                d.message_id for d in client.read("mixed", queue, first, 100)]
            assert columns.count == end - first
        assert sum(client.read_columns("mixed", q, 0, 100).count for q in range(4)) == 40
        bodies = sorted(body for q in range(4) for body in client.read_columns("mixed", q, 0, 100).column("body"))
        assert bodies == sorted(m.body for m in mixed(40))
    finally:
        client.close()
        server.stop()
