"""A server that stops answering without closing the connection (a hung process, a partition
that drops packets): a server of the test's own is stopped (SIGSTOP: the kernel keeps its
sockets open and acknowledges what is sent, nothing answers), then continued (SIGCONT).

The worker must take the silence for an outage (``transport_unavailable``: its backoff, then
joining again), not wait on it for ever, and go on consuming once the server answers; a publish
must raise `BackendUnavailableError` once ``publish_timeout`` has passed. Real servers only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from backends.cache.redis import RedisCache
from backends.errors import BackendUnavailableError, CacheUnavailableError
from backends.transport.kafka_mock import MockCluster
from broker.async_client import AsyncClient
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerUnavailableError
from reliable import App, Message
from reliable.settings import Settings
from tests.broker.server.serving import ServerProcess
from tests.framework.refusals import Running
from tests.framework.test_refused_transports import NatsServer
from tests.transports.test_redis_server_events import RedisServer
from tests.waiting import wait_until

BOUND = 60.0
"""Seconds a publish to a stopped server may take before the test calls it blocked (it gives up
after its publish_timeout)."""


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped (checked in /proc) for the block's duration, continued after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(pid) == "T", "the server process stopped")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def worker_app(folder: Path, url: str, done: list[int]) -> App:
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{folder / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": url,
                                       "RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "2"}))

    @app.handler("orders", group="shipping")
    def ship(msg: Message, tx: object) -> None:
        done.append(msg.body["n"])

    return app


def publish_outcome(app: App, body: dict[str, int]) -> BaseException | None:
    """What ``app.publish`` raised (None: it returned); fails the test if it is still blocked."""
    outcome: list[BaseException | None] = []

    def send() -> None:
        try:
            app.publish("orders", body, message_id=f"hung-{body['n']}")  # a retry's copy: the same id
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert outcome, f"app.publish still blocked on the stopped server after {BOUND} s"
    return outcome[0]


def rides_through_a_hang(app: App, pid: int, done: list[int], restore: Callable[[], None] = lambda: None) -> None:
    """Run ``app``'s worker, stop the server under it, then continue it; what each side did."""
    with capture_logs() as logs:
        run = Running(app)
        try:
            app.publish("orders", {"n": 1})
            wait_until(lambda: done == [1], "the first message handled")
            with stopped(pid):
                wait_until(lambda: any(e["event"] == "transport_unavailable" for e in logs) or run.error,
                           "the worker to take the stopped server for an outage")  # the old code: blocked
                assert isinstance(publish_outcome(app, {"n": 99}), BackendUnavailableError)
                assert run.thread.is_alive()
            restore()
            app.publish("orders", {"n": 2})
            wait_until(lambda: 2 in done or run.error, "the message published after SIGCONT handled")
        finally:
            app.stop()
            run.join()
    assert run.error is None, run.error
    # 99 reached the server's socket: handled once if the server read it after SIGCONT
    assert sorted(n for n in done if n != 99) == [1, 2] and done.count(99) <= 1
    unavailable = [e for e in logs if e["event"] == "transport_unavailable"]
    assert unavailable and all(e["log_level"] == "warning" for e in unavailable)


def rides_through_a_hang_of_its_own(server: RedisServer | NatsServer, folder: Path) -> None:
    """`rides_through_a_hang` on ``server``, started here and stopped after (continued first),
    its transport's ``request_timeout`` at 1 s."""
    server.start()
    try:
        assert server.process is not None
        done: list[int] = []
        app = worker_app(folder, f"{server.url}?request_timeout=1", done)
        rides_through_a_hang(app, server.process.pid, done)
        app.close()
    finally:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(240)
def test_a_redis_server_that_stops_answering_is_an_outage_waited_out(tmp_path: Path) -> None:
    """The old transport had no socket timeout: the worker's claim and ``app.publish`` waited on
    the silent connection for ever."""
    rides_through_a_hang_of_its_own(RedisServer(tmp_path), tmp_path)



@pytest.mark.timeout(240)
def test_a_broker_server_that_stops_answering_is_an_outage_waited_out(tmp_path: Path) -> None:
    """The old client waited for every reply without a bound: the worker's fetch and
    ``app.publish`` waited on the silent connection for ever."""
    server = ServerProcess(tmp_path / "data").start()
    assert server.process is not None and server.process.pid is not None
    try:
        done: list[int] = []
        app = worker_app(tmp_path, f"{server.url}?publish_retry=1", done)
        rides_through_a_hang(app, server.process.pid, done)
        app.close()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()



@pytest.mark.timeout(240)
def test_a_publish_larger_than_the_socket_buffers_to_a_stopped_broker_server_raises(tmp_path: Path) -> None:
    """The kernel takes a few MiB for a server that reads nothing: the rest of a larger publish
    waited in ``sendall`` for ever, holding the connection's send lock (and so every other call
    of the client, even the ping that tells a silent server)."""
    server = ServerProcess(tmp_path / "data").start()
    assert server.process is not None and server.process.pid is not None
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": f"{server.url}?publish_retry=1",
                                       "RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "2"}))
    bodies = [{"n": n, "pad": "x" * (3 << 20)} for n in range(12)]  # 36 MiB over frames of 8 MiB
    outcome: list[BaseException | None] = []

    def send() -> None:
        try:
            app.publish_many("orders", bodies, message_ids=[f"big-{n}" for n in range(len(bodies))])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        app.publish("orders", {"n": -1})  # connected: its hello answered
        with stopped(server.process.pid):
            thread = threading.Thread(target=send, daemon=True)
            thread.start()
            thread.join(BOUND)
            assert outcome, f"app.publish_many still blocked on the stopped server after {BOUND} s"
            assert isinstance(outcome[0], BackendUnavailableError), outcome[0]
        app.publish("orders", {"n": 1})  # the client connects again and goes on
        app.close()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(240)
def test_a_nats_server_that_stops_answering_is_an_outage_waited_out(tmp_path: Path) -> None:
    """nats-py's pings (``ping_interval``, ``max_outstanding_pings``) and the transport's
    ``request_timeout`` already bound the wait: this keeps them."""
    rides_through_a_hang_of_its_own(NatsServer(tmp_path / "js"), tmp_path)


@pytest.mark.timeout(240)
def test_the_async_broker_client_gives_up_a_stopped_server_and_goes_on_after(tmp_path: Path) -> None:
    """`AsyncClient` awaited every reply without a bound: a fetch of a stopped server's member
    (and every call behind it) waited for ever."""
    server = ServerProcess(tmp_path / "data").start()
    assert server.process is not None and server.process.pid is not None
    pid = server.process.pid

    async def run() -> None:
        async with AsyncClient(server.url, publish_retry_seconds=1) as client:
            member = await client.join("shipping", ["orders"])
            with stopped(pid):
                try:
                    await asyncio.wait_for(client.fetch(member, 10, 1.0), BOUND)
                except TimeoutError:
                    raise AssertionError(f"fetch still waiting on the stopped server after {BOUND} s") from None
                except BrokerUnavailableError:
                    pass
                else:
                    raise AssertionError("a fetch of the stopped server returned")
            await client.publish("orders", [OutgoingMessage(b"{}", message_id="after")])
            member = await client.join("shipping", ["orders"])  # the first went with its connection
            assert [d.message_id for d in await client.fetch(member, 10, 5.0)] == ["after"]

    try:
        asyncio.run(run())
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(120)
def test_the_redis_cache_of_a_stopped_server_is_unavailable_not_waited_on(tmp_path: Path) -> None:
    """`RedisCache` sets its own socket timeouts (2 s): this keeps them."""
    server = RedisServer(tmp_path)
    server.start()
    assert server.process is not None
    cache = RedisCache(server.url)
    outcome: list[BaseException | None] = []

    def look() -> None:
        try:
            cache.seen("hung", ["t1"])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        cache.remember("hung", ["t1"], 60)
        with stopped(server.process.pid):
            thread = threading.Thread(target=look, daemon=True)
            thread.start()
            thread.join(BOUND)
            assert outcome, f"the cache still waiting on the stopped server after {BOUND} s"
            assert isinstance(outcome[0], CacheUnavailableError), outcome[0]
        assert cache.seen("hung", ["t1"]) == {"t1"}  # connected again once it answers
        cache.close()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@contextmanager
def server_of_its_own(kind: str, folder: Path) -> Iterator[tuple[str, int]]:
    """A server of ``kind`` started for the test: its URL, its request timeout far above `BOUND`
    (120 s), and the pid that serves it."""
    if kind == "kafka":
        with MockCluster(brokers=1) as cluster:
            yield f"{cluster.url}?request_timeout=120", cluster.pid
            os.kill(cluster.pid, signal.SIGCONT)
        return
    if kind == "reliable":
        broker = ServerProcess(folder / "data").start()
        assert broker.process is not None and broker.process.pid is not None
        try:
            yield f"{broker.url}?publish_retry=120", broker.process.pid
        finally:
            os.kill(broker.process.pid, signal.SIGCONT)
            broker.stop()
        return
    server = RedisServer(folder) if kind == "redis" else NatsServer(folder / "js")
    server.start()
    assert server.process is not None
    try:
        yield f"{server.url}?request_timeout=120", server.process.pid
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["redis", "reliable", "nats", "kafka"])
def test_a_publish_to_a_stopped_server_gives_up_within_publish_timeout(kind: str, tmp_path: Path) -> None:
    """Each try of ``app.publish`` waits at most what remains of ``publish_timeout`` (2 s here),
    not the transport's own request timeout (120 s here): the old last try ran a whole request
    timeout past it, and still waited on the stopped server after `BOUND`."""
    with server_of_its_own(kind, tmp_path) as (url, pid):
        app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                           "RELIABLE_TRANSPORT__URL": url,
                                           "RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "2"}))
        app.publish("orders", {"n": 0})  # connected, the topic made
        with capture_logs() as logs, stopped(pid):
            outcome = publish_outcome(app, {"n": 1})
        assert isinstance(outcome, BackendUnavailableError), outcome
        tries = [e for e in logs if e["event"] in ("publish_retried", "publish_gave_up")]
        assert tries[-1]["event"] == "publish_gave_up" and tries[-1]["error"] == str(outcome)
        assert all(0 < e["timeout"] <= 2 for e in tries), tries  # each try bounded by what remained
        app.close()
