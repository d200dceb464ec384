"""What a Redis server does to a running ``redis://`` worker: keys deleted under it.

A stream deleted (``DEL``, ``FLUSHALL``, a restart without persistence) or
trimmed (``XTRIM``) while the group still leases or has scheduled one of its
entries: the old code leased the missing entry again at every visibility
timeout and counted it, and the deleted entries, as pending for ever, so
``run(until_idle=True)`` never ended. A redis-server of the test's own is
restarted without persistence under a worker, which goes on. Real Redis only.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from backends.clock import FakeClock
from backends.transport.redis_streams import RedisStreamsTransport
from backends.types import OutgoingMessage
from reliable import App, Message
from reliable.settings import Settings
from reliable.testing import test_app
from tests.cluster.ports import free_ports, wait_listening
from tests.framework.refusals import Running
from tests.waiting import wait_until


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    opened = redis.Redis.from_url(redis_url)
    yield opened
    opened.close()


def test_a_redelivery_whose_stream_was_deleted_is_dropped_named_and_the_run_ends(
    tmp_path: Path, redis_url: str, client: redis.Redis, unique: str
) -> None:
    app = test_app(tmp_path, transport=f"{redis_url}?namespace={unique}&queues=1",
                   settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    done: list[str] = []

    @app.handler("orders", group="shipping")
    def ship(msg: Message, tx: object) -> None:
        if msg.body["id"] == "a":  # its stream is deleted while it is in hand, then it fails
            client.delete(f"{unique}:stream:orders:0")
            app.publish("orders", {"id": "b"})
            raise ConnectionError("the warehouse is down")
        done.append(msg.body["id"])

    app.publish("orders", {"id": "a"})
    with capture_logs() as logs:
        run = Running(app, until_idle=True)
        run.join()  # the old code leased the missing entry again for ever
    assert run.error is None, run.error
    assert done == ["b"]
    (vanished,) = [e for e in logs if e["event"] == "transport.message_vanished"]
    assert (vanished["group"], vanished["topic"], vanished["offset"]) == ("shipping", "orders", 0)
    assert client.zcard(f"{unique}:inflight:shipping:orders") == 0
    app.close()


def test_entries_deleted_or_trimmed_under_the_head_are_not_pending(
    redis_url: str, client: redis.Redis, unique: str
) -> None:
    transport = RedisStreamsTransport(redis_url, FakeClock(), namespace=unique, queues=1)
    stream = f"{unique}:stream:orders:0"
    member = transport.subscribe("g", ["orders"])
    transport.publish("orders", [OutgoingMessage(b"{}", message_id=f"m{n}") for n in range(3)])
    client.xtrim(stream, maxlen=1, approximate=False)  # m0 and m1 trimmed before anyone read them
    assert member.pending() == 1
    assert [m.id for m in member.fetch(10, 0)] == ["m2"]
    client.delete(stream)  # m2 is in flight: its lease falls due with nothing to deliver
    assert member.pending() == 1
    transport._clock.advance(transport.visibility_timeout + 1)  # type: ignore[attr-defined]
    assert member.fetch(10, 0) == []
    assert member.pending() == 0  # the old code: 4 (3 from the head, 1 lease) for ever
    transport.publish("orders", [OutgoingMessage(b"{}", message_id="after")])
    assert [m.id for m in member.fetch(10, 0)] == ["after"]
    member.close()
    transport.purge()
    transport.close()


class RedisServer:
    """A redis-server of the test's own, without persistence: a restart empties it."""

    def __init__(self, folder: Path, *options: str) -> None:
        self.port, self.folder, self.options = free_ports(1)[0], folder, options
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder), *self.options], stdout=subprocess.DEVNULL)
        wait_listening(self.port, 30)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)


def test_a_worker_goes_on_after_redis_restarts_empty(tmp_path: Path) -> None:
    """No stream, no group (``NOGROUP``), no queue count: each is made again; what is published
    after the restart is handled, once."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                           "RELIABLE_TRANSPORT__URL": server.url}))
        done: list[int] = []

        @app.handler("orders", group="shipping")
        def ship(msg: Message, tx: object) -> None:
            done.append(msg.body["n"])

        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1], "the first message handled")
        server.stop()
        server.start()
        for n in range(2, 6):
            app.publish("orders", {"n": n})
        wait_until(lambda: sorted(done) == [1, 2, 3, 4, 5], "every message after the restart handled")
        app.stop()
        run.join()
        assert run.error is None, run.error
        app.close()
    finally:
        server.stop()


def test_a_group_destroyed_under_a_worker_is_made_again_and_says_where_it_reads_from(
    tmp_path: Path, redis_url: str, client: redis.Redis, unique: str
) -> None:
    """The old worker made the group again and read the stream again from its start in silence."""
    app = test_app(tmp_path, transport=f"{redis_url}?namespace={unique}&queues=1")
    done: list[int] = []

    @app.handler("orders", group="shipping")
    def ship(msg: Message, tx: object) -> None:
        done.append(msg.body["n"])

    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1] or run.error, "the first message handled")
        client.xgroup_destroy(f"{unique}:stream:orders:0", "shipping")
        app.publish("orders", {"n": 2})
        wait_until(lambda: done == [1, 2] or run.error, "the message published after the deletion handled")
        app.stop()
        run.join()
    assert run.error is None, run.error
    assert app.stats()["duplicate"] == 1  # 1, read again from the stream's start, skipped by its token
    (recreated,) = [e for e in logs if e["event"] == "transport.group_recreated"]  # not when first made
    assert (recreated["group"], recreated["topic"], recreated["queue"], recreated["offset"]) == (
        "shipping", "orders", 0, 0)
    assert recreated["log_level"] == "warning" and "XGROUP DESTROY" in recreated["reason"]
    app.close()


@pytest.mark.parametrize("settling", ["ack", "nack"])
def test_an_ack_or_nack_meeting_a_busy_redis_leaves_the_group_and_goes_on(tmp_path: Path, settling: str) -> None:
    """Another client's script runs past ``busy-reply-threshold``: Redis answers every other
    command ``BUSY`` until ``SCRIPT KILL``. The old worker took it for a refusal: an ack ended
    ``run()``; a nack had the message dead-lettered, whose copy met ``BUSY`` too, and ended it."""
    server = RedisServer(tmp_path, "--busy-reply-threshold", "100")
    server.start()
    admin = redis.Redis.from_url(server.url)
    try:
        app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                           "RELIABLE_TRANSPORT__URL": server.url,
                                           "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": "1",
                                           "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
                                           "RELIABLE_RETRY__INITIAL_DELAY": "0.1"}))
        done: list[int] = []
        held: list[str] = []

        def busy() -> None:  # this client waits for its script's end: SCRIPT KILL ends it with an error
            with pytest.raises(redis.ResponseError, match="killed"):
                redis.Redis.from_url(server.url).eval("while true do end", 0)

        def answers_busy() -> bool:
            try:
                admin.ping()
            except redis.ResponseError as exc:
                return str(exc).startswith("BUSY")
            return False

        @app.handler("orders", group="shipping")
        def ship(msg: Message, tx: object) -> None:
            if msg.body["n"] == 1 and not held:
                held.append(msg.id)
                threading.Thread(target=busy, daemon=True).start()
                wait_until(answers_busy, "Redis to answer BUSY")  # what the ack or nack meets
                if settling == "nack":
                    raise ConnectionError("the warehouse is down")
            done.append(msg.body["n"])

        app.publish("orders", {"n": 1})
        with capture_logs() as logs:
            run = Running(app)
            wait_until(lambda: any(e["event"] == "transport_unavailable" and e.get("settling") == settling
                                   for e in logs) or run.error, f"the {settling} to meet BUSY")
            admin.script_kill()
            app.publish("orders", {"n": 2})
            came_again = (lambda: app.stats()["duplicate"] == 1) if settling == "ack" else (lambda: True)
            wait_until(lambda: (sorted(done) == [1, 2] and came_again()) or run.error,
                       "both messages handled" + (", the unacked one come again" if settling == "ack" else ""))
            assert run.thread.is_alive()
            app.stop()
            run.join()
        assert run.error is None, run.error
        assert sorted(done) == [1, 2]  # each handled once: a duplicate is skipped by its token
        met = [e for e in logs if e.get("settling") is not None]
        assert len(met) == 1 and met[0]["messages"] == held and "BUSY" in met[0]["error"]
        if settling == "nack":
            assert app.stats()["dead_lettered"] == 0 and app.stats()["processed"] == 2
        app.close()
    finally:
        admin.close()
        server.stop()


def test_an_ack_meeting_redis_out_of_memory_keeps_the_group_and_goes_on(tmp_path: Path) -> None:
    """``maxmemory`` reached (``noeviction``): Redis refuses every write with ``OOM``. The old worker
    took it for a refusal for good and ended ``run()`` at its first write, here the ack; it is now a refusal of writes for now, as a full disk: the member keeps its
    place, waits its backoff, and goes on once memory is back."""
    server = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    server.start()
    admin = redis.Redis.from_url(server.url)
    try:
        app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                           "RELIABLE_TRANSPORT__URL": server.url}))
        done: list[int] = []
        held: list[str] = []

        @app.handler("orders", group="shipping")
        def ship(msg: Message, tx: object) -> None:
            if not held:
                held.append(msg.id)
                admin.set("ballast", b"x" * 3_000_000)
                admin.config_set("maxmemory", "1mb")  # below what Redis holds: every write refused
                with pytest.raises(redis.exceptions.OutOfMemoryError):
                    admin.set("probe", b"x")
            done.append(msg.body["n"])

        app.publish("orders", {"n": 1})
        with capture_logs() as logs:
            run = Running(app)
            wait_until(lambda: any(e.get("settling") == "ack" for e in logs) or run.error, "the ack to meet OOM")
            admin.config_set("maxmemory", "0")
            app.publish("orders", {"n": 2})
            wait_until(lambda: done == [1, 2] or run.error, "the message published after it handled")
            assert run.thread.is_alive()
            app.stop()
            run.join()
        assert run.error is None, run.error
        (met,) = [e for e in logs if e.get("settling") is not None]
        assert met["event"] == "transport_writes_refused" and met["messages"] == held
        assert "maxmemory" in met["error"]
        assert not any(e["event"] in ("transport_unavailable", "transport_settle_refused") for e in logs)
        assert app.stats()["processed"] == 2 and app.stats()["dead_lettered"] == 0
        app.close()
    finally:
        admin.close()
        server.stop()


def test_a_fetch_under_redis_out_of_memory_spends_no_delivery_of_a_due_message(tmp_path: Path) -> None:
    """A fetch claims from each topic in turn: the group's topic, then its ``%RETRY%`` queue. Out of
    memory, the topic's claim of a message whose lease ended went through (a script that has
    written may go on writing) and the retry queue's was refused at its first write: the fetch
    raised, the message was leased and counted once more and lost to the caller until its lease
    ended (measured: after three such fetches its next delivery was its third, not its second)."""
    server = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    server.start()
    admin = redis.Redis.from_url(server.url)
    clock = FakeClock()
    transport = RedisStreamsTransport(server.url, clock, queues=1)
    try:
        transport.publish("orders", [OutgoingMessage(b"{}", message_id="m1")])
        member = transport.subscribe("shipping", ["orders"])
        assert [m.attempt for m in member.fetch(10, 0)] == [1]
        admin.set("ballast", b"x" * 3_000_000)
        admin.config_set("maxmemory", "1mb")  # below what Redis holds: every write refused
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.set("probe", b"x")
        attempts = []
        for _ in range(3):
            clock.advance(transport.visibility_timeout + 1)  # the lease of m1 ends: due again
            attempts += [m.attempt for m in member.fetch(10, 0)]
        assert attempts == [2, 3, 4]  # each fetch hands it out: a delivery counted is a delivery made
        admin.config_set("maxmemory", "0")
        member.close()
    finally:
        transport.purge()
        transport.close()
        admin.close()
        server.stop()
