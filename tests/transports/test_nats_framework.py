"""The framework on `nats://` (`tests.transports.framework`): transactional commits, kill -9 chaos, a cut.

Real NATS JetStream, real PostgreSQL store and Redis cache. Every test runs in
a namespace of its own (``?namespace=``) whose streams are deleted afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from backends.transport.nats_transport import NatsTransport
from reliable import App
from tests.tcp_proxy import TcpProxy
from tests.transports.framework import CutSuite, DeadLetters, assert_nothing_pending
from tests.transports.test_nats import read_dead_letters


def nats_transport(app: App) -> NatsTransport:
    transport = app.runtime.transport
    assert isinstance(transport, NatsTransport)
    return transport


class TestNatsFramework(CutSuite):
    visibility_timeout = 3.0  # AckWait: how long a killed worker's messages stay with it

    @pytest.fixture
    def server(self, nats_url: str) -> str:
        return nats_url

    @pytest.fixture
    def place(self, nats_url: str, unique: str) -> Iterator[str]:
        """A namespace of its own on the real server, its streams deleted afterwards."""
        yield f"{nats_url}?namespace={unique}"
        with NatsTransport(nats_url, namespace=unique) as transport:
            transport.purge()

    def check_acked(self, server: str, app: App, group: str, flaky_attempts: list[int]) -> None:
        assert flaky_attempts == [1, 2]  # JetStream's delivery count
        with self.open(server, group) as transport:
            assert_nothing_pending(transport, group)  # every message acked or terminated

    def dead_letters(self, server: str, group: str) -> DeadLetters:
        return read_dead_letters(server, group, group, 1)

    def open(self, server: str, namespace: str) -> NatsTransport:
        return NatsTransport(server, namespace=namespace)

    def proxied_address(self, server: str) -> tuple[str, int]:
        parts = urlsplit(server)
        return parts.hostname or "127.0.0.1", parts.port or 4222

    def through(self, server: str, proxy: TcpProxy, namespace: str) -> str:
        return f"nats://127.0.0.1:{proxy.port}?namespace={namespace}"

    def cut_seen(self, app: App) -> bool:
        return not nats_transport(app).connected

    @contextmanager
    def settled(self, server: str, app: App, namespace: str) -> Iterator[Callable[[], bool]]:
        # every message acked: what the member held came back after AckWait, a duplicate
        with NatsTransport(server, namespace=namespace) as check:
            watcher = check.subscribe(namespace, [namespace])  # never fetches: reads the consumers' counts
            yield lambda: watcher.pending() == 0
            watcher.close()

    def check_reconnected(self, app: App) -> None:
        assert nats_transport(app).reconnects >= 1
