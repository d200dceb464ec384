"""A log-in the server takes long to check (a costly password hash, other log-ins waiting their
turn under load) is waited for, not taken for a hung server; a hello never answered still is.

The server reads nothing behind a hello until it has checked it, so the ping a client sends
after `broker.client.ANSWER_TIMEOUT` of silence cannot be answered during a slow check: the
old clients gave the connection up after two such silences (10 s) and every call failed, however
patiently the server was checking. The silence bound is made short here (the check of the
user's hash, pbkdf2 at a million rounds, is far longer than two of them) instead of hashing for
10 s; the hello's own bound (`HELLO_TIMEOUT`) is shortened for the stopped server.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from broker import async_client, client
from broker.async_client import AsyncClient
from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerUnavailableError
from broker.server.auth import hash_password
from tests.broker.server.serving import ServerProcess
from tests.transports.test_hung_servers import stopped

SILENCE = 0.02
"""The patched `ANSWER_TIMEOUT`: a check of the slow user's password takes far longer than two."""
SLOW_HASH = hash_password("slow", method="pbkdf2_sha256", iterations=1_000_000)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("slow-login")
    settings = folder / "reliable.toml"
    settings.write_text(f'[broker.users.slow]\npassword_hash = "{SLOW_HASH}"\nadmin = true\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


@pytest.fixture
def short_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (client, async_client):
        monkeypatch.setattr(module, "ANSWER_TIMEOUT", SILENCE)


def test_a_log_in_slower_than_the_ping_silence_is_waited_for(server, unique, short_silence) -> None:
    with capture_logs() as logs:
        producer = Client(server.url, user="slow", password="slow")
        try:
            producer.publish(unique, [OutgoingMessage(b"after a slow log-in")])  # old: unreachable
        finally:
            producer.close()
    assert [e["event"] for e in logs if e["event"] == "client.hello_slow"] == ["client.hello_slow"]


def test_the_async_client_waits_for_a_slow_log_in_too(server, unique, short_silence) -> None:
    async def run() -> None:
        async with AsyncClient(server.url, user="slow", password="slow") as producer:
            await producer.publish(unique, [OutgoingMessage(b"after a slow log-in")])

    with capture_logs() as logs:
        asyncio.run(run())
    assert [e["event"] for e in logs if e["event"] == "client.hello_slow"] == ["client.hello_slow"]


def test_a_hello_a_stopped_server_never_answers_is_given_up(tmp_path: Path, monkeypatch, unique) -> None:
    monkeypatch.setattr(client, "HELLO_TIMEOUT", 0.5)
    monkeypatch.setattr(async_client, "HELLO_TIMEOUT", 0.5)
    started = ServerProcess(tmp_path / "data").start()
    assert started.process is not None and started.process.pid is not None
    try:
        with stopped(started.process.pid):  # the kernel still accepts the connection
            with pytest.raises(BrokerUnavailableError, match="no answer to the hello in 0.5 s"):
                Client(started.url, publish_retry_seconds=0).publish(unique, [OutgoingMessage(b"x")])

            async def run() -> None:
                async with AsyncClient(started.url, publish_retry_seconds=0) as producer:
                    await producer.publish(unique, [OutgoingMessage(b"x")])

            with pytest.raises(BrokerUnavailableError, match="no answer to the hello in 0.5 s"):
                asyncio.run(run())
    finally:
        os.kill(started.process.pid, signal.SIGCONT)
        started.stop()
