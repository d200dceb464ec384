"""``max_unacked_bytes`` and ``max_fetch_bytes`` count a message's key, tag, id and headers, not
its body alone.

They counted bodies only: a client publishing one-byte bodies under large headers (each message
within the frame size) and fetching without acking made the server hold every message's headers,
a hundred times the bound here, while the bound read as unreached. The sizes are UTF-8 bytes, so
characters of four bytes count four.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp

from broker.client import Client
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.sizes import delivery_size
from broker.delivery.values import Delivery, OutgoingMessage
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.waiting import wait_until

HEADERS = 20 * 1024  # of headers per message, under a one-byte body
LIMIT = 5 * HEADERS + HEADERS // 2  # five and a half messages
MESSAGES = 40


def message(n: int, wide: bool = False) -> OutgoingMessage:
    """A one-byte body under HEADERS bytes of headers (``wide``: of four-byte characters)."""
    value = "\U0001F600" * (HEADERS // 4 - 4) if wide else "h" * (HEADERS - 16)
    return OutgoingMessage(b"x", key=f"{n:04}", headers={"x-padding": value})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, max_unacked_bytes=LIMIT) as started:
        yield started


def held_bytes(deliveries: list[Delivery]) -> int:
    return sum(delivery_size(d) for d in deliveries)


@pytest.mark.parametrize("wide", [False, True], ids=["ascii", "four-byte characters"])
def test_a_native_consumer_of_header_heavy_messages_is_held_to_the_bound(server, unique, wide) -> None:
    producer = Client(threaded.native(server))
    producer.publish(unique, [message(n, wide) for n in range(MESSAGES)])
    producer.close()
    client = Client(threaded.native(server))
    member = client.join(unique, [unique], prefetch=1000)
    held: list[Delivery] = []
    while got := client.fetch(member, 1000, 0.0):
        held += got
    assert sum(len(d.body) for d in held) <= len(held)  # the bodies alone: nothing, a byte each
    assert HEADERS <= held_bytes(held) // len(held)  # each delivery does hold its headers
    assert LIMIT <= held_bytes(held) <= LIMIT + 2 * HEADERS  # all 40 (800 KiB) when bodies were counted
    assert f"broker_unacked_bytes {float(held_bytes(held))}" in server.metrics.exposition().decode()  # as watched
    keys = [d.key for d in held]
    while len(keys) < MESSAGES:  # a consumer that acks gets everything, once
        client.ack(member, [held.pop(0).receipt])
        got = client.fetch(member, 1000, 0.0)
        held += got
        keys += [d.key for d in got]
        assert held_bytes(held) <= LIMIT + 2 * HEADERS
    assert sorted(keys) == [f"{n:04}" for n in range(MESSAGES)]
    client.close()


class Received(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.frames: list[stomp.utils.Frame] = []

    def on_message(self, frame: stomp.utils.Frame) -> None:
        with self.lock:
            self.frames.append(frame)


def test_a_stomp_subscriber_of_header_heavy_messages_is_held_to_the_bound(server, unique) -> None:
    producer = Client(threaded.native(server))
    producer.publish(unique, [message(n) for n in range(MESSAGES)])
    producer.close()
    connection, listener = stomp.Connection12([("127.0.0.1", server.port("stomp"))]), Received()
    connection.set_listener("received", listener)
    connection.connect(wait=True)
    connection.subscribe(f"/queue/{unique}", id="1", ack="client-individual",
                         headers={"activemq.prefetchSize": "1000"})
    wait_until(lambda: len(listener.frames) * HEADERS >= LIMIT, "the subscriber to be handed the bound's worth")
    probe = Client(threaded.native(server))  # the group's own state: what is still to deliver
    wait_until(lambda: sum(q.lag for q in probe.lag(unique)) >= MESSAGES, "the lag to be read")
    assert len(listener.frames) <= LIMIT // HEADERS + 2  # all 40 when bodies were counted
    connection.ack(str(listener.frames[0].headers["ack"]))
    before = len(listener.frames)
    wait_until(lambda: len(listener.frames) > before, "a message in the room the ack freed")
    assert len(listener.frames) <= LIMIT // HEADERS + 3
    probe.close()
    connection.disconnect()


def test_one_fetch_hands_out_max_fetch_bytes_of_whole_messages(tmp_path: Path, unique) -> None:
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1, max_fetch_bytes=LIMIT))
    try:
        broker.publish(unique, [message(n) for n in range(MESSAGES)])
        member = broker.join(unique, [unique], prefetch=1000)
        first = broker.fetch(member, 1000, 0)
        assert 1 <= len(first) and held_bytes(first) <= LIMIT  # all 40 when bodies were counted
    finally:
        broker.close()
