"""A client on the other protocol's port is refused at once, with an error that says so.

The broker's native client pointed at its STOMP port sent a hello that the STOMP listener waited
on for the whole ``handshake_timeout`` (10 s), and then failed as an outage, which callers retry:
a wrong port in a URL looked like a broker that was down, and a client whose broker had moved off
a port kept knocking on whichever listener took it next. RabbitMQ's clients raise
``IncompatibleProtocolError`` for the same mistake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp

from broker.async_client import AsyncClient
from broker.client import Client
from broker.errors import NotABrokerError
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.waiting import wait_until

REFUSED = r"does not answer in the broker's native protocol .* it sent b'ERROR\\n.*STOMP port"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}) as started:  # the handshake timeout never passes
        yield started


def test_the_native_client_on_the_stomp_port_is_told_it_is_not_the_broker(server) -> None:
    client = Client(f"127.0.0.1:{server.port('stomp')}")
    with pytest.raises(NotABrokerError, match=REFUSED):
        client.topics()
    client.close()
    wait_until(lambda: server.metrics.totals()["connections_open"] == 0, "the connection closed")
    assert server.metrics.totals()["connections"] == 1  # refused, not tried again


def test_the_async_client_on_the_stomp_port_is_told_it_is_not_the_broker(server) -> None:
    async def topics() -> None:
        client = AsyncClient(f"127.0.0.1:{server.port('stomp')}")
        try:
            await client.topics()
        finally:
            await client.close()

    with pytest.raises(NotABrokerError, match=REFUSED):
        asyncio.run(topics())


def test_a_stomp_client_on_the_native_port_is_refused(server) -> None:
    connection = stomp.Connection12([("127.0.0.1", server.port("native"))], reconnect_attempts_max=1)
    with pytest.raises(stomp.exception.ConnectFailedException):
        connection.connect(wait=True)
    wait_until(lambda: server.metrics.totals()["connections_open"] == 0, "the connection closed")
