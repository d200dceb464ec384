"""Real workers and the real broker while the wall clock steps (an NTP correction, a resumed VM).

`SteppedClock` is the real clock, its wall reading moved at will while the monotonic one runs
on. The broker engine runs in this process on it (``embedded://``, the owner); the worker that
holds a message runs in a process of its own, reaching the engine over its local socket, and is
stopped (SIGSTOP: its connection open, its member silent) or left busy in its handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from backends.cache.memory import MemoryCache
from backends.clock import FakeClock, SystemClock
from backends.errors import BackendUnavailableError
from backends.transport import open_transport
from backends.transport.base import Transport
from backends.transport.memory import MemoryTransport
from backends.types import OutgoingMessage
from reliable import Message
from reliable.health import serve_probes
from reliable.testing import test_app
from tests.framework.test_outages import socket_closed_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0
GROUP = "billing"


class SteppedClock(SystemClock):
    """The real clocks, the wall one off by what `step` added (the monotonic one untouched)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def step(self, seconds: float) -> None:
        self.offset += seconds


WORKER = """
import sys, time
from pathlib import Path
from backends.clock import SystemClock
from reliable.testing import test_app

folder = Path(sys.argv[1])
app = test_app(folder, clock=SystemClock(), transport=f"embedded://{folder / 'broker'}")

@app.handler("orders", group="billing")
def bill(msg, tx):
    (folder / "started").write_text(str(msg.attempt))
    while not (folder / "go").exists():  # busy until the test says
        time.sleep(0.01)
    (folder / "done").touch()

app.run()
"""


@pytest.fixture
def clock() -> SteppedClock:
    return SteppedClock()


@pytest.fixture
def owner(tmp_path: Path, clock: SteppedClock) -> Iterator[Transport]:
    """The engine, in this process on the stepped clock: leases of 2 s, members silent 3 s leave."""
    transport = open_transport(f"embedded://{tmp_path / 'broker'}?visibility_timeout=2&session_timeout=3",
                               clock=clock)
    transport.publish("orders", [OutgoingMessage(b'{"id": 1}', message_id="o1")])
    yield transport
    transport.close()


@pytest.fixture
def worker(tmp_path: Path, owner: Transport) -> Iterator[subprocess.Popen[str]]:
    """A worker process holding ``o1`` in its handler."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}, "PYTHONPATH": str(ROOT),
           "RELIABLE_LOG__LEVEL": "warning"}
    process = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "started").exists() or process.poll() is not None, "the worker to take o1")
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_hung_workers_message_comes_back_on_time_after_the_wall_clock_steps_back(
    clock: SteppedClock, owner: Transport, worker: subprocess.Popen[str]
) -> None:
    os.kill(worker.pid, signal.SIGSTOP)  # hung: its lease ends, its member falls silent
    clock.step(-HOUR)
    with owner.subscribe(GROUP, ["orders"]) as member:
        (again,) = wait_until(lambda: member.fetch(1, 0.2), "o1 redelivered within its lease, not an hour later")
        member.ack([again])
    assert (again.id, again.attempt) == ("o1", 2)


def test_a_busy_workers_message_is_not_redelivered_when_the_wall_clock_steps_forward(
    tmp_path: Path, clock: SteppedClock, owner: Transport, worker: subprocess.Popen[str]
) -> None:
    clock.step(HOUR)
    with owner.subscribe(GROUP, ["orders"]) as member:
        assert member.fetch(1, 0.5) == []  # the busy worker's lease and membership hold
        (tmp_path / "go").touch()
        wait_until(lambda: member.pending() == 0, "the busy worker's ack")
        assert member.fetch(1, 0.2) == []
    assert (tmp_path / "started").read_text() == "1"


def test_a_worker_busy_in_a_handler_stays_alive_when_the_wall_clock_steps_forward(
    tmp_path: Path, clock: SteppedClock
) -> None:
    app = test_app(tmp_path, clock=clock)
    entered, release = threading.Event(), threading.Event()

    @app.handler("orders", group=GROUP)
    def bill(msg: Message, tx) -> None:
        entered.set()
        release.wait(60)

    app.publish("orders", {"id": 1})
    probes = serve_probes(app, 0)
    running = threading.Thread(target=app.run)
    running.start()
    try:
        assert entered.wait(60)
        clock.step(HOUR)
        assert probe(probes.server_address[1]) == 200  # the loop went round seconds ago, not an hour
    finally:
        release.set()
        app.stop()
        running.join()
        probes.shutdown()
        app.close()


def probe(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


class SteppingBack(FakeClock):
    """A fake clock whose wall reading steps back an hour during the first wait."""

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if len(self.sleeps) == 1:
            self.step(-HOUR)


def test_a_publish_through_an_outage_gives_up_after_its_timeout_when_the_wall_clock_steps_back(
    tmp_path: Path,
) -> None:
    with socket_closed_port() as port:
        clock = SteppingBack()
        app = test_app(tmp_path, clock=clock, transport=f"redis://127.0.0.1:{port}/0",
                       settings={"RELIABLE_TRANSPORT__PUBLISH_TIMEOUT": "5"})
    try:
        with pytest.raises(BackendUnavailableError):
            app.publish("orders", {"id": 1})
        assert sum(clock.sleeps) < 5 + 2.0  # the timeout, and one last wait at most: not an hour
    finally:
        app.close()


@pytest.mark.parametrize("step", [HOUR, -HOUR], ids=["forward", "back"])
def test_a_cached_token_lives_its_ttl_whichever_way_the_wall_clock_steps(step: float) -> None:
    clock = FakeClock()
    cache = MemoryCache(clock=clock)
    cache.remember("billing", ["t1"], 60)
    clock.step(step)
    clock.advance(59)
    assert cache.seen("billing", ["t1"]) == {"t1"}
    clock.advance(2)
    assert cache.seen("billing", ["t1"]) == set()


def test_a_twin_of_a_held_lease_is_deferred_at_most_a_lease_after_the_wall_clock_steps_back(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    app = test_app(tmp_path, clock=clock)
    calls: list[str] = []

    @app.handler("orders", group=GROUP, token="body.id", lease=30.0)
    def bill(msg: Message) -> None:
        calls.append(msg.body["id"])

    try:
        assert app.store.lease(GROUP, "o1", 30.0).acquired  # another worker is calling
        clock.step(-HOUR)  # this machine's wall clock, an hour behind the holder's now
        app.publish("orders", {"id": "o1"})
        with capture_logs() as logs:
            app.run(until_idle=True)
        waits = [entry["retry_in"] for entry in logs if entry["event"] == "lease_held"]
        assert waits and max(waits) <= 30.001  # asked again every lease, not an hour later
        assert calls == ["o1"]  # once the holder's lease ended
    finally:
        app.close()


def test_a_batch_commit_acks_on_its_interval_after_the_wall_clock_steps_back(tmp_path: Path) -> None:
    clock = FakeClock()
    app = test_app(tmp_path, clock=clock, settings={"RELIABLE_COMMIT__STRATEGY": "batch",
                                                    "RELIABLE_COMMIT__INTERVAL": "5"})
    probe = app.transport.subscribe(GROUP, ["orders"])  # fetches nothing: counts what is not acked
    unacked: list[int] = []

    @app.handler("orders", group=GROUP, token="body.id")
    def bill(msg: Message) -> None:  # a, b and c each published by the one before: a fetch each
        if msg.body["id"] == "b":
            clock.step(-HOUR)  # while b's handler runs
            clock.advance(5)  # the batch's interval, since a was done
        if msg.body["id"] == "c":
            unacked.append(probe.pending())
        else:
            app.publish("orders", {"id": chr(ord(msg.body["id"]) + 1)})

    try:
        app.publish("orders", {"id": "a"})
        app.run(until_idle=True)
        assert unacked == [1]  # a and b acked on the interval after b: c alone is out
    finally:
        probe.close()
        app.close()


@pytest.mark.parametrize("step", [HOUR, -HOUR], ids=["forward", "back"])
def test_a_memory_transport_lease_lasts_its_timeout_whichever_way_the_wall_clock_steps(step: float) -> None:
    clock = FakeClock()
    transport = MemoryTransport(clock, visibility_timeout=30.0)
    transport.publish("orders", [OutgoingMessage(b"o1")])
    holder, twin = transport.subscribe(GROUP, ["orders"]), transport.subscribe(GROUP, ["orders"])
    [held] = holder.fetch(1, 0)
    clock.step(step)
    clock.advance(29)
    assert twin.fetch(1, 0) == []  # the holder's lease runs on: not handed out twice at once
    clock.advance(2)  # the holder went silent: its lease ended on time
    [again] = twin.fetch(1, 0)
    assert (again.id, again.attempt) == (held.id, 2)
    twin.in_progress([again])  # still working on it: 30 s more from now
    clock.step(step)
    clock.advance(29)
    assert holder.fetch(1, 0) == []
    clock.advance(2)
    assert [m.attempt for m in holder.fetch(1, 0)] == [3]
    transport.close()


@pytest.mark.parametrize("step", [HOUR, -HOUR], ids=["forward", "back"])
def test_a_memory_transport_delay_lasts_its_length_whichever_way_the_wall_clock_steps(step: float) -> None:
    clock = FakeClock()
    transport = MemoryTransport(clock)
    transport.publish("orders", [OutgoingMessage(b"o1"), OutgoingMessage(b"o2", delay=10.0)])
    member = transport.subscribe(GROUP, ["orders"])
    [first] = member.fetch(2, 0)
    member.nack(first, 10.0)
    clock.step(step)
    due = member.next_due()
    assert due is not None and abs(due - (clock.time() + 10.0)) < 0.001  # wall time, 10 s ahead
    clock.advance(9)
    assert member.fetch(2, 0) == []
    clock.advance(2)
    assert sorted(m.payload for m in member.fetch(2, 0)) == [b"o1", b"o2"]  # the nacked and the delayed
    transport.close()
