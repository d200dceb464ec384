"""The framework on `nats://` (`tests.transports.framework`): transactional commits, kill -9 chaos, a cut.

Real NATS JetStream, real PostgreSQL store and Redis cache. Every test runs in
a namespace of its own (``?namespace=``) whose streams are deleted afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
from structlog.testing import capture_logs

from backends.transport.nats_transport import NatsTransport
from reliable import App, Message
from reliable.settings import Settings
from tests.tcp_proxy import TcpProxy
from tests.transports.effects import dead_letter_counts
from tests.transports.framework import CutSuite, DeadLetters, Poison, assert_nothing_pending
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
        return read_dead_letters(server, group, group, 2)  # the suite dead-letters two messages

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


def test_a_dead_letter_copy_jetstream_cannot_carry_is_refused_and_the_record_kept(
    nats_url: str, postgres_url: str, redis_url: str, unique: str
) -> None:
    """A message with 60 KB of headers (JetStream takes 64 KiB) fails for good: its dead-letter
    copy, with the failure's headers too, is over 64 KiB, which JetStream leaves unanswered (a
    timeout, taken for an outage: the worker left its group and got the message again, for ever).
    Now the copy is refused by name, the message is settled, and the store's record is its letter."""
    place = f"{nats_url}?namespace={unique}"
    suite = TestNatsFramework()
    app = App(Settings.load(None, env=suite.settings_env(place, postgres_url, redis_url)))

    @app.handler(unique, group=unique, token="body.token", fatal=[Poison])
    def handle(message: Message, tx) -> None:
        raise Poison("y" * 20_000)  # the copy carries 8 KB of it, and 8 KB of the traceback

    app.publish(unique, {"token": "big"}, headers={"padding": "x" * 60_000})
    with capture_logs() as logs:
        app.run(until_idle=True)
    assert dead_letter_counts(postgres_url, unique) == {"big": 1}
    (refused,) = [e for e in logs if e["event"] == "dead_letter_copy_refused"]
    assert "JetStream takes at most 65536 bytes of headers" in refused["error"]
    with suite.open(nats_url, unique) as transport:
        assert_nothing_pending(transport, unique)
        transport.purge()
    app.close()
