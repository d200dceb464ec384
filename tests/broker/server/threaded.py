"""A broker server in this process, its event loop on a thread of its own, for tests that look at
its state (metrics, lock-outs) and inject a fake clock; and clients connecting from a chosen one of
this machine's 127.x.x.x addresses, so one test has many client addresses."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from broker.client import CONNECT_TIMEOUT, Client
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.protocol.codec import FrameDecoder, decode_body
from broker.server.auth import load_users
from broker.server.config import Limits, ServerConfig, TlsConfig
from broker.server.engine import Engine, OutgoingMessage
from broker.server.server import BrokerServer
from broker.store.clock import Clock


class ClientFrom(Client):
    """The project's client, connecting from ``source`` (one of this machine's 127.x.x.x)."""

    def __init__(self, address: str, source: str, **options: Any) -> None:
        super().__init__(address, **options)
        self.source = source

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self.address, CONNECT_TIMEOUT, source_address=(self.source, 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@contextmanager
def serving(tmp_path: Path, clock: Clock, users: Mapping[str, Any], tls: TlsConfig | None = None,
            delivery: DeliveryConfig | None = None, **limits: Any) -> Iterator[BrokerServer]:
    """A server with ``users`` on free native and STOMP ports, its loop on a thread of its own."""
    broker, loop = Broker(tmp_path / "broker", delivery), asyncio.new_event_loop()
    started: Future[BrokerServer] = Future()
    stopping = asyncio.Event()
    config = ServerConfig(port=0, stomp_port=0, metrics_port=0, users=load_users(users),
                          limits=Limits(**limits), tls=tls)

    async def serve() -> None:
        async with BrokerServer(Engine(broker), config, clock=clock) as server:
            server.loop = loop  # type: ignore[attr-defined]  # for `publish_on_loop`
            started.set_result(server)
            await stopping.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        yield started.result(timeout=30)
    finally:
        loop.call_soon_threadsafe(stopping.set)
        thread.join(30)
        loop.close()
        broker.close()


def publish_on_loop(server: BrokerServer, topic: str, body: bytes) -> None:
    """Publish through the server's engine on its own loop, as a session does, with no connection
    of the test's own (one that an absurd ``idle_timeout`` would cut between publishes)."""
    asyncio.run_coroutine_threadsafe(server.engine.publish(topic, [OutgoingMessage(body)]),
                                     server.loop).result(30)  # type: ignore[attr-defined]


def native(server: BrokerServer) -> str:
    return f"127.0.0.1:{server.port('native')}"


def counted(counter: Counter, **labels: str) -> float:
    """The sum of ``counter``'s series with these labels (a server metric, read in process)."""
    return sum(sample.value for family in counter.collect() for sample in family.samples
               if sample.name.endswith("_total") and labels.items() <= sample.labels.items())


def replies(sock: socket.socket, count: int) -> list[dict[str, Any]]:
    """The next ``count`` native replies (or fewer, if the server closes first)."""
    decoder, found = FrameDecoder(1 << 24), []
    while len(found) < count and (data := sock.recv(1 << 20)):
        found += [decode_body(payload) for payload in decoder.feed(data)]
    return found
