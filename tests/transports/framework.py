"""The framework suite every transport runs: a handler with transactional commits, kill -9 chaos,
the outbox chain under kill -9, a cut.

Written once, run per transport (like huey's storage tests): a transport's
``test_<name>_framework.py`` subclasses `FrameworkSuite` (and `CutSuite` where
its connection goes through a `TcpProxy`) and gives only what is its own:

* the fixture ``server``: what the transport's own checks read (its URL, or
  the Kafka mock cluster), and ``place``: the URL of a fresh place on it,
  cleaned up afterwards;
* ``visibility_timeout`` and, where Redis is not used, the ``cache_url`` fixture;
* the hooks below, each saying how the transport shows one outcome.

The store is the real PostgreSQL; the handler's side effects go to the table
of the ``effects`` fixture (`tests/transports/conftest.py`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from backends.transport.base import Transport
from backends.types import OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings
from tests.tcp_proxy import TcpProxy
from tests.transports.chaos import kill_9_chaos
from tests.transports.effects import dead_letter_counts, effect_counts, insert_effect, wait_until
from tests.transports.outbox_chain import outbox_chain_with_kills

WAIT_CUT = 30.0
"""The bound on the wait for the handler held at the cut."""

DeadLetters = list[tuple[bytes, dict[str, str]]]
"""Dead-lettered messages as the transport keeps them: payload and headers."""


class Flaky(Exception):
    """A failure worth another try."""


class Poison(Exception):
    """A failure no retry helps."""


def without_reliable_variables() -> dict[str, str]:
    """This process's environment without ``RELIABLE_*``: a child worker reads only the test's settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}


def assert_nothing_pending(transport: Transport, group: str) -> None:
    """Every message of ``group`` acked (or terminated): none waiting, none held, none delayed."""
    subscription = transport.subscribe(group, [group])
    assert subscription.pending() == 0
    subscription.close()


class FrameworkSuite:
    """The tests every transport runs; a subclass gives the fixtures and hooks the module docstring names."""

    visibility_timeout: float
    """The transport's lease in these tests: how long a killed worker's messages stay with it."""

    @pytest.fixture
    def cache_url(self, redis_url: str) -> str:
        return redis_url

    def settings_env(self, url: str, postgres_url: str, cache_url: str) -> dict[str, str]:
        """The settings of the test's apps (as ``RELIABLE_*`` variables): transactional commits on ``url``."""
        return {
            "RELIABLE_TRANSPORT__URL": url,
            "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(self.visibility_timeout),
            "RELIABLE_STORE__URL": postgres_url,
            "RELIABLE_CACHE__URL": cache_url,
            "RELIABLE_COMMIT__STRATEGY": "transactional",
            "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
            "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
            "RELIABLE_LOG__LEVEL": "warning",
        }

    def check_acked(self, server: Any, app: App, group: str, flaky_attempts: list[int]) -> None:
        """Every message acked on the transport, and the flaky message's deliveries counted as it counts them."""
        raise NotImplementedError

    def dead_letters(self, server: Any, group: str) -> DeadLetters:
        """What the transport holds in ``group``'s dead-letter queue (or topic, or stream)."""
        raise NotImplementedError

    def test_a_handler_with_transactional_commits(
        self, server: Any, place: str, postgres_url: str, cache_url: str, effects: str, unique: str
    ) -> None:
        app = App(Settings.load(None, env=self.settings_env(place, postgres_url, cache_url)))
        flaky_attempts: list[int] = []

        @app.handler(unique, group=unique, token="body.token", fatal=[Poison], retry_on=[Flaky])
        def handle(message: Message, tx) -> None:
            if message.body["token"] == "poison":
                raise Poison("never")
            if message.body["token"] == "huge-poison":  # more than any wire carries in headers
                raise Poison("x" * 300_000)
            if message.body["token"] == "flaky":
                flaky_attempts.append(message.attempt)
                if len(flaky_attempts) == 1:
                    raise Flaky("once")
            insert_effect(tx, effects, message)

        tokens = [f"t{n}" for n in range(100)]
        # published before any worker runs: the app declares its handler's group first
        app.publish_many(unique, [{"token": t} for t in tokens * 2 + ["flaky", "poison", "huge-poison"]])
        runner = threading.Thread(target=app.run)
        runner.start()
        try:
            wait_until(lambda: len(effect_counts(postgres_url, effects)) == 101
                       and dead_letter_counts(postgres_url, unique) == {"poison": 1, "huge-poison": 1},
                       runner.is_alive)
        finally:
            app.stop()
            runner.join()
        assert effect_counts(postgres_url, effects) == {t: 1 for t in [*tokens, "flaky"]}
        self.check_acked(server, app, unique, flaky_attempts)
        letters = {json.loads(payload)["token"]: headers for payload, headers in self.dead_letters(server, unique)}
        assert letters.keys() == {"poison", "huge-poison"}, letters.keys()
        assert letters["poison"]["x-reliable-error-message"] == "never"
        assert letters["huge-poison"]["x-reliable-error-message"].startswith("x" * 1000)  # cut: see Failure.summary
        assert len(letters["huge-poison"]["x-reliable-error-message"]) < 300_000
        app.close()

    @pytest.mark.parametrize(
        ("kills", "count"), [(20, 10_000), pytest.param(100, 50_000, marks=pytest.mark.soak)]
    )
    def test_kill_9_at_random_points_each_token_once_each_poison_dead_lettered_once(
        self, place: str, postgres_url: str, cache_url: str, effects: str, unique: str, kills: int, count: int
    ) -> None:
        env = {**without_reliable_variables(), **self.settings_env(place, postgres_url, cache_url)}
        kill_9_chaos(env, postgres_url, effects, unique, kills, count)

    @pytest.mark.parametrize(
        ("kills", "count"), [(20, 10_000), pytest.param(100, 50_000, marks=pytest.mark.soak)]
    )
    def test_outbox_chain_under_kill_9_each_b_effect_once_in_order_per_key(
        self, place: str, postgres_url: str, cache_url: str, unique: str, kills: int, count: int
    ) -> None:
        env = {**without_reliable_variables(), **self.settings_env(place, postgres_url, cache_url)}
        outbox_chain_with_kills(env, postgres_url, unique, kills, count)


class CutSuite(FrameworkSuite):
    """`FrameworkSuite` and a connection cut (through a `TcpProxy`) while a handler holds a message."""

    def open(self, server: Any, namespace: str) -> Transport:
        """A transport of the test's own on ``server``, in ``namespace``, outside the app."""
        raise NotImplementedError

    def proxied_address(self, server: Any) -> tuple[str, int]:
        """The host and port the proxy forwards to."""
        raise NotImplementedError

    def through(self, server: Any, proxy: TcpProxy, namespace: str) -> str:
        """The transport URL of ``namespace`` with its connections through ``proxy``."""
        raise NotImplementedError

    def cut_seen(self, app: App) -> bool:
        """Whether the app has met the cut (before the proxy lets connections through again)."""
        raise NotImplementedError

    def settled(self, server: Any, app: App, namespace: str) -> AbstractContextManager[Callable[[], bool]]:
        """A check, open while the test waits, that what the member held when cut came back and was acked."""
        raise NotImplementedError

    def check_reconnected(self, app: App) -> None:
        """The transport's own evidence that the cut cost it a connection."""
        raise NotImplementedError

    def test_a_cut_connection_reconnects_and_loses_nothing(
        self, server: Any, place: str, postgres_url: str, cache_url: str, effects: str, unique: str
    ) -> None:  # ``place``: the namespace ``unique`` it uses, cleaned up afterwards
        proxy = TcpProxy(*self.proxied_address(server))
        app = App(Settings.load(None, env=self.settings_env(self.through(server, proxy, unique), postgres_url,
                                                             cache_url)))
        entered, cut = threading.Event(), threading.Event()

        @app.handler(unique, group=unique, token="body.token")
        def handle(message: Message, tx) -> None:
            if message.body["token"] == "t50" and not cut.is_set():
                entered.set()
                assert cut.wait(WAIT_CUT), "the connection was never cut"
            insert_effect(tx, effects, message)

        tokens = [f"t{n}" for n in range(200)]
        with self.open(server, unique) as producer:
            producer.declare(unique, [unique])
            producer.publish(unique, [OutgoingMessage(json.dumps({"token": t}).encode()) for t in tokens])
        runner = threading.Thread(target=app.run)
        runner.start()
        try:
            assert entered.wait(WAIT_CUT)  # t50 is in flight
            proxy.cut()  # every connection through the proxy dropped, new ones refused
            cut.set()  # t50's handler commits; its ack meets a dead connection
            wait_until(lambda: self.cut_seen(app), runner.is_alive, 0.05)
            proxy.restore()
            with self.settled(server, app, unique) as settled:
                wait_until(lambda: len(effect_counts(postgres_url, effects)) == len(tokens) and settled(),
                           runner.is_alive)
        finally:
            app.stop()
            runner.join()
            proxy.close()
        assert effect_counts(postgres_url, effects) == {t: 1 for t in tokens}
        self.check_reconnected(app)
        app.close()
