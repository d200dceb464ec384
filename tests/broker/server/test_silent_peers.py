"""Silent clients: a STOMP subscriber that never sends is not cut off, and a peer that vanished
(half-open: no FIN, no RST) is found by TCP keepalive, which the server turns on for every client.

A STOMP consumer in ``ack:auto`` mode without heart-beats (stomp.py's default) sends nothing after
its SUBSCRIBE: the server cut it at ``idle_timeout`` while messages were flowing to it, every two
minutes. ActiveMQ and RabbitMQ close such a connection only on missed heart-beats they negotiated;
a vanished peer is the kernel's to find, by keepalive probes, as Kafka and RabbitMQ turn them on.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.waiting import wait_until

IDLE = 0.5


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, idle_timeout=IDLE) as started:
        yield started


class Inbox(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.bodies: list[str] = []
        self.disconnected = False

    def on_message(self, frame: stomp.utils.Frame) -> None:
        self.bodies.append(frame.body)

    def on_disconnected(self) -> None:
        self.disconnected = True


def connected(server: BrokerServer) -> tuple[stomp.Connection12, Inbox]:
    connection, inbox = stomp.Connection12([("127.0.0.1", server.port("stomp"))]), Inbox()
    connection.set_listener("inbox", inbox)
    connection.connect(wait=True)  # no heart-beats, stomp.py's default
    return connection, inbox


def test_a_silent_auto_ack_subscriber_is_not_cut_off_while_messages_flow(server, unique) -> None:
    subscriber, inbox = connected(server)
    subscriber.subscribe(f"/queue/{unique}", id="1", ack="auto")  # its last frame
    producer = Client(threaded.native(server))
    for n in range(3):
        _, witness = connected(server)  # silent, without subscriptions: cut at idle_timeout
        producer.publish(unique, [OutgoingMessage(f"m{n}".encode())])
        wait_until(lambda: witness.disconnected, "the witness to be cut: idle_timeout has passed")  # noqa: B023
        assert not inbox.disconnected
    producer.publish(unique, [OutgoingMessage(b"last")])
    wait_until(lambda: len(inbox.bodies) == 4, "every message")
    producer.close()
    assert inbox.bodies == ["m0", "m1", "m2", "last"] and not inbox.disconnected
    wait_until(lambda: server.metrics.totals()["connections_open"] == 1, "the subscriber alone open")
    subscriber.disconnect()


def test_a_connection_without_subscriptions_is_still_cut_when_idle(server) -> None:
    _, inbox = connected(server)
    wait_until(lambda: inbox.disconnected, "the idle connection to be cut")


@pytest.mark.parametrize("listener", ["native", "stomp"])
def test_every_client_connection_has_tcp_keepalive_on(server, listener: str) -> None:
    port = server.port(listener)
    if listener == "native":
        client = Client(threaded.native(server))
        client.topics()
        wait_until(lambda: "timer:(keepalive," in _sockets(port), "the kernel's keepalive timer")
        client.close()
    else:
        connection, _ = connected(server)
        connection.subscribe("/queue/keepalive", id="1")  # not cut at idle_timeout meanwhile
        wait_until(lambda: "timer:(keepalive," in _sockets(port), "the kernel's keepalive timer")
        connection.disconnect()


def subscribed_within_a_millisecond(server: BrokerServer, unique: str) -> tuple[stomp.Connection12, Inbox, str]:
    """A subscriber whose CONNECT and SUBSCRIBE each arrived within the 1 ms idle timeout (on a loaded
    machine some attempts are cut before: those are the timeout at work, and tried again on a queue
    of their own)."""
    for attempt in range(200):
        queue = f"{unique}-{attempt}"
        try:
            subscriber, inbox = connected(server)
            subscriber.subscribe(f"/queue/{queue}", id="1", ack="auto")
            threaded.publish_on_loop(server, queue, b"first")
            wait_until(lambda: inbox.bodies or inbox.disconnected, "the first message or the cut")  # noqa: B023
        except stomp.exception.StompException:
            continue
        if not inbox.disconnected:
            inbox.bodies.clear()
            return subscriber, inbox, queue
    raise AssertionError("no subscriber got its SUBSCRIBE in within 1 ms in 200 attempts")


def _sockets(port: int) -> str:
    """``ss``'s view of the server's side of connections on ``port``, with their timers."""
    return subprocess.run(["ss", "-tno", "state", "established", f"( sport = :{port} )"],
                          capture_output=True, text=True, check=True).stdout


def test_a_subscriber_silent_for_thousands_of_idle_timeouts_stays(tmp_path, unique) -> None:
    """Each idle timeout of a silent subscriber reads on; that must not nest (a read within a read
    per timeout ran out of stack: the session failed)."""
    with threaded.serving(tmp_path, FakeClock(), {}, idle_timeout=0.001) as server:
        subscriber, inbox, queue = subscribed_within_a_millisecond(server, unique)
        for n in range(300):  # each round trip outlasts several 1 ms idle timeouts
            # not through a client connection: the 1 ms idle timeout would cut it between publishes,
            # and its hello on the next one whenever the machine is loaded
            threaded.publish_on_loop(server, queue, f"m{n}".encode())
            wait_until(lambda: len(inbox.bodies) > n or inbox.disconnected, f"message {n}")  # noqa: B023
        assert not inbox.disconnected and len(inbox.bodies) == 300
        try:  # the timeout was in force for a connection without subscriptions all along
            _, witness = connected(server)
            wait_until(lambda: witness.disconnected, "the witness to be cut")
        except stomp.exception.ConnectFailedException:
            pass  # cut before its CONNECTED: the same timeout
        subscriber.disconnect()
