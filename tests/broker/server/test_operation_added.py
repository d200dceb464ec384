"""An operation added in one place, a table entry with its engine function, reaches every client.

The fixture declares ``topic_names`` in `OPERATIONS` and nothing else: the
native server (in this process, on a real TCP port) parses, authorises and
runs it, and the sync client, the asyncio client and the local-socket client
call it as a method, with its default, its bound and its refusal.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from broker.async_client import AsyncClient
from broker.client import Client
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.local import LocalClient, LocalServer
from broker.protocol.access import Access
from broker.protocol.errors import MalformedFrameError
from broker.protocol.kinds import INT, STR, STRS
from broker.protocol.operations import BY_METHOD, OPERATIONS, Field, Operation
from broker.server.config import ServerConfig
from broker.server.engine import Engine
from broker.server.server import BrokerServer


def _topic_names(api: Any, prefix: str, times: int) -> list[str]:
    return sorted(t.name for t in api.topics() if t.name.startswith(prefix)) * times


@pytest.fixture
def added(monkeypatch: pytest.MonkeyPatch) -> Operation:
    op = Operation("topic_names", (Field("prefix", STR), Field("times", INT, 1, 1)),
                   Field("names", STRS), Access(anyone=True), engine=_topic_names)
    monkeypatch.setitem(OPERATIONS, op.name, op)
    monkeypatch.setitem(BY_METHOD, op.method, op)
    return op


@pytest.fixture
def broker(tmp_path: Path, unique: str) -> Iterator[Broker]:
    engine = Broker(tmp_path / "broker")
    engine.publish(unique, [OutgoingMessage(b"x")])
    yield engine
    engine.close()


@pytest.fixture
def address(broker: Broker) -> Iterator[str]:
    """A native server over ``broker`` on a free port, its loop on a thread of its own."""
    loop = asyncio.new_event_loop()
    started: Future[BrokerServer] = Future()
    stopping = asyncio.Event()

    async def serve() -> None:
        async with BrokerServer(Engine(broker), ServerConfig(port=0, stomp_port=None)) as server:
            started.set_result(server)
            await stopping.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    yield f"127.0.0.1:{started.result(timeout=30).port('native')}"
    loop.call_soon_threadsafe(stopping.set)
    thread.join(30)
    loop.close()


def test_an_operation_declared_once_is_served_and_called_by_every_client(
        added, broker, address, tmp_path, unique) -> None:
    client = Client(address)
    assert client.topic_names(unique) == [unique]
    assert client.topic_names(prefix=unique, times=2) == [unique, unique]
    with pytest.raises(MalformedFrameError, match="topic_names: field 'times' must be >= 1"):
        client.topic_names(unique, 0)
    client.close()

    async def over_asyncio() -> list[str]:
        async with AsyncClient(address) as asynchronous:
            return list(await asynchronous.topic_names(unique, 3))

    assert asyncio.run(over_asyncio()) == [unique] * 3

    local_server = LocalServer(broker, tmp_path / "broker")
    try:
        local = LocalClient(tmp_path / "broker")
        assert local.topic_names(unique) == [unique]
        local.close()
    finally:
        local_server.close()


def test_a_client_has_no_method_the_table_does_not_declare() -> None:
    with pytest.raises(AttributeError, match="no operation 'topic_names'"):
        Client("127.0.0.1:1").topic_names  # noqa: B018 - the lookup is what is tested
