"""A member belongs to the connection it joined on: once a client gave that connection up (a
hung server), leaving the member must not make a connection only to be told it is gone.

The worker leaves its group before it logs an outage and waits (``reliable.worker``): the old
clients connected again for the leave and waited out a hello the stopped server never answers,
and the worker only then learnt of the outage. The clients' silence bound is shortened here.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from broker import async_client, client
from broker.async_client import AsyncClient
from broker.client import Client
from broker.errors import BrokerUnavailableError
from tests.broker.server.serving import ServerProcess
from tests.transports.test_hung_servers import stopped


def test_leaving_after_the_connection_was_given_up_connects_to_nobody(tmp_path: Path, monkeypatch, unique) -> None:
    for module in (client, async_client):
        monkeypatch.setattr(module, "ANSWER_TIMEOUT", 0.05)
    server = ServerProcess(tmp_path / "data").start()
    assert server.process is not None and server.process.pid is not None
    sync = Client(server.url)

    async def fetch_then_leave(asynchronous: AsyncClient) -> None:
        member = await asynchronous.join(unique, [unique])
        with stopped(pid):
            with pytest.raises(BrokerUnavailableError, match="not even to a ping"):
                await asynchronous.fetch(member, 10, 5.0)
            await asynchronous.leave(member)  # the old client: a hello to the stopped server

    pid = server.process.pid
    try:
        member = sync.join(unique, [unique])
        asynchronous = AsyncClient(server.url)
        with stopped(pid):
            with pytest.raises(BrokerUnavailableError, match="not even to a ping"):
                sync.fetch(member, 10, 5.0)
            sync.leave(member)  # the old client: a hello to the stopped server, then unreachable
        asyncio.run(fetch_then_leave(asynchronous))
        assert sync.join(unique, [unique])  # connects again once the server answers
        sync.close()
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()
