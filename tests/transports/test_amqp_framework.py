"""The framework on `amqp://` (`tests.transports.framework`): transactional commits, kill -9 chaos, a cut.

Real RabbitMQ (quorum queues), real PostgreSQL store and Redis cache. Every
test runs in a namespace of its own (``?namespace=``) whose queues and
exchanges are deleted afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import pytest

from backends.transport.amqp_transport import AmqpTransport
from reliable import App
from tests.tcp_proxy import TcpProxy
from tests.transports.framework import CutSuite, DeadLetters, assert_nothing_pending
from tests.transports.test_amqp import read_dead_letters


class TestAmqpFramework(CutSuite):
    visibility_timeout = 3.0  # the AMQP heartbeat of the tests' connections

    @pytest.fixture
    def server(self, amqp_url: str) -> str:
        return amqp_url

    @pytest.fixture
    def place(self, amqp_url: str, unique: str) -> Iterator[str]:
        """A namespace of its own on the real server, its queues deleted afterwards: the suite's
        topics (each consumed by a group of its name) are ``unique`` and the outbox chain's two."""
        yield f"{amqp_url}?namespace={unique}"
        with AmqpTransport(amqp_url, namespace=unique) as transport:
            for topic in (unique, f"{unique}-a", f"{unique}-b"):
                transport.declare(topic, [topic])  # so that purge knows the group's queues
            transport.purge()

    def check_acked(self, server: str, app: App, group: str, flaky_attempts: list[int]) -> None:
        assert flaky_attempts == [1, 2]  # counted through the delay queue
        with self.open(server, group) as transport:
            assert_nothing_pending(transport, group)  # every message acked, none waiting in a delay queue

    def dead_letters(self, server: str, group: str) -> DeadLetters:
        return read_dead_letters(server, group, group)

    def open(self, server: str, namespace: str) -> AmqpTransport:
        return AmqpTransport(server, namespace=namespace)

    def proxied_address(self, server: str) -> tuple[str, int]:
        parts = urlsplit(server)
        return parts.hostname or "127.0.0.1", parts.port or 5672

    def through(self, server: str, proxy: TcpProxy, namespace: str) -> str:
        parts = urlsplit(server)
        netloc = f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, f"namespace={namespace}", ""))

    def cut_seen(self, app: App) -> bool:
        return app.stats()["processed"] >= 51  # t50 committed, its ack lost

    @contextmanager
    def settled(self, server: str, app: App, namespace: str) -> Iterator[Callable[[], bool]]:
        # t50 (and what the member held) came back from RabbitMQ; t50 is now a duplicate
        yield lambda: app.stats()["duplicate"] >= 1

    def check_reconnected(self, app: App) -> None:
        assert app.stats()["duplicate"] >= 1  # the cut really cost an ack: t50 was redelivered
