"""A connection holds at most ``max_unacked_bytes`` of message bodies unacknowledged.

The bound was by count only (``max_subscriptions`` x prefetch): a client subscribing with a large
prefetch to a queue of large messages, and never acking, made the server hold every body it was
handed, gigabytes of them. Now, once a connection's members (or STOMP subscriptions) together
hold ``max_unacked_bytes``, nothing more is delivered to it until acks free room (one message
past the bound at most: the first of a fetch goes out whatever its size). Nothing is dropped and
no error is sent: a slow consumer that acks gets every message, once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp

from broker.client import Client
from broker.delivery.config import DeliveryConfig
from broker.delivery.values import OutgoingMessage
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.waiting import wait_until

BODY = 100 * 1024
LIMIT = 10 * BODY + BODY // 2  # ten and a half messages
MESSAGES = 30  # three times what the bound lets out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, delivery=DeliveryConfig(queues=2),
                          max_unacked_bytes=LIMIT) as started:
        yield started


def publish(server: BrokerServer, topic: str) -> None:
    producer = Client(threaded.native(server))
    producer.publish(topic, [OutgoingMessage(f"{n:04}".encode() + b"x" * (BODY - 4)) for n in range(MESSAGES)])
    producer.close()


def test_native_members_of_one_connection_share_the_bound_and_acks_free_room(server, unique) -> None:
    publish(server, unique)
    client = Client(threaded.native(server))
    members = [client.join(unique, [unique], prefetch=1000) for _ in range(2)]  # a queue each
    held = {m: [d for d in client.fetch(m, 1000, 0.0)] for m in members}
    held_bytes = sum(len(d.body) for got in held.values() for d in got)
    assert LIMIT <= held_bytes <= LIMIT + BODY  # 3 MB without the bound
    assert all(client.fetch(m, 1000, 0.0) == [] for m in members)  # nothing more until an ack
    other = Client(threaded.native(server))  # another connection has a window of its own
    assert other.fetch(other.join(f"{unique}-other", [unique], prefetch=1000), 1000, 0.0)
    other.close()
    bodies = []
    while len(bodies) < MESSAGES:  # a slow consumer: ack one, get one, until every message came
        member = next(m for m in members if held[m])
        done = held[member].pop(0)
        bodies.append(done.body)
        client.ack(member, [done.receipt])
        for m in members:
            held[m] += client.fetch(m, 1000, 0.0)
        assert sum(len(d.body) for got in held.values() for d in got) <= LIMIT + BODY
    assert sorted(body[:4] for body in bodies) == [f"{n:04}".encode() for n in range(MESSAGES)]
    client.close()


def test_a_waiting_fetch_is_handed_messages_once_an_ack_frees_room(server, unique) -> None:
    publish(server, unique)
    client = Client(threaded.native(server))
    member = client.join(unique, [unique], prefetch=1000)
    held: list = []
    while got := client.fetch(member, 1000, 0.0):
        held += got
    assert LIMIT <= sum(len(d.body) for d in held) <= LIMIT + BODY
    waited: list[int] = []
    waiting = threading.Thread(target=lambda: waited.append(len(client.fetch(member, 1000, 30.0))))
    waiting.start()
    client.ack(member, [d.receipt for d in held[:3]])
    waiting.join(60)
    assert waited and 1 <= waited[0] <= 4  # the room three acks freed (one message past it at most)
    client.close()


class Unacked(stomp.ConnectionListener):
    """Counts what a STOMP client holds unacknowledged: bodies received less those it acked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.frames: list[stomp.utils.Frame] = []
        self.acked = self.held = self.most = 0

    def on_message(self, frame: stomp.utils.Frame) -> None:
        with self.lock:
            self.frames.append(frame)
            self.held += len(frame.body)
            self.most = max(self.most, self.held)

    def acking(self, frame: stomp.utils.Frame) -> str:
        with self.lock:  # counted before the ACK is sent: the server frees room only after
            self.acked += 1
            self.held -= len(frame.body)
        return str(frame.headers["ack"])


def test_a_stomp_subscriber_with_a_large_prefetch_is_held_to_the_bound(server, unique) -> None:
    publish(server, unique)
    connection, listener = stomp.Connection12([("127.0.0.1", server.port("stomp"))]), Unacked()
    connection.set_listener("unacked", listener)
    connection.connect(wait=True)
    connection.subscribe(f"/queue/{unique}", id="1", ack="client-individual",
                         headers={"activemq.prefetchSize": "1000"})
    wait_until(lambda: listener.held >= LIMIT, "the subscriber to be handed the bound's worth")
    while listener.acked < MESSAGES:  # ack the oldest, wait for the next, until every message came
        received = len(listener.frames)
        connection.ack(listener.acking(listener.frames[listener.acked]))
        if received < MESSAGES:
            wait_until(lambda: len(listener.frames) > received, "a message in the room the ack freed")  # noqa: B023
    assert listener.most <= LIMIT + BODY  # 3 MB without the bound
    assert sorted(f.body[:4] for f in listener.frames) == [f"{n:04}" for n in range(MESSAGES)]
    connection.disconnect()
