"""Lease mode: the lease is renewed while a slow handler runs, and expires when its holder dies.

A handler slower than its lease is not repeated by a concurrent twin (the
twin's attempt is observed: it found the lease held); a holder killed with
``kill -9`` in another process lets a twin take over once the lease expires.
Real clock, a store shared by holder and twin.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from backends.clock import SystemClock
from reliable import Message
from reliable.testing import FakeClock, test_app

ROOT = Path(__file__).resolve().parents[2]


class FirstSleep(SystemClock):
    """A real clock that notes when its app first waits (after its first attempt) and signals it."""

    def __init__(self) -> None:
        self.first_wait_at: float | None = None
        self.waited = threading.Event()

    def sleep(self, seconds: float) -> None:
        if self.first_wait_at is None:
            self.first_wait_at = self.time()
        self.waited.set()
        super().sleep(seconds)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def lease_expiry(store_url: str, group: str, token: str) -> float:
    engine = create_engine(store_url)
    with engine.connect() as conn:
        expiry = conn.execute(text("select expires_at from reliable_tokens where namespace = :n and token = :t"),
                              {"n": group, "t": token}).scalar_one()
    engine.dispose()
    return float(expiry)


def test_a_handler_slower_than_its_lease_is_not_repeated_by_a_twin(tmp_path, unique) -> None:
    lease = 1.0  # renewed every third of it: 0.3 s lost the lease under a loaded suite (5 workers, 2 cores)
    twin_clock = FirstSleep()
    holder = test_app(tmp_path, clock=SystemClock())
    twin = test_app(tmp_path, clock=twin_clock)  # the same store (SQLite file in tmp_path)
    calls: list[str] = []
    started = threading.Event()
    started_at: list[float] = []

    @holder.handler("mail", group="mailer", token="body.id", lease=lease)
    def send(msg: Message) -> str:
        calls.append("holder")
        started_at.append(time.time())
        started.set()
        assert twin_clock.waited.wait(30)  # slower than its lease: until the twin has tried
        return "sent"

    @twin.handler("mail", group="mailer", token="body.id", lease=lease)
    def send_twin(msg: Message) -> str:
        calls.append("twin")
        return "sent by twin"

    holder.publish("mail", {"id": unique})
    twin.publish("mail", {"id": unique})
    running = threading.Thread(target=holder.run, kwargs={"until_idle": True})
    running.start()
    assert started.wait(30)
    wait_until(lambda: time.time() > started_at[0] + 2 * lease)  # the first lease has long run out
    twin.run(until_idle=True)
    running.join(30)

    assert calls == ["holder"]
    assert twin_clock.first_wait_at is not None and twin_clock.first_wait_at > started_at[0] + 2 * lease
    twin_stats = twin.stats()
    assert twin_stats["deferred"] >= 1  # the twin really tried, and found the lease held
    assert (twin_stats["processed"], twin_stats["duplicate"]) == (0, 1)
    assert holder.stats()["processed"] == 1
    holder.close()
    twin.close()


def test_a_holder_killed_with_kill_9_lets_a_twin_in_after_expiry(tmp_path, postgres_url, unique) -> None:
    lease = 1.0
    marker = tmp_path / "holder.pid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update(RELIABLE_STORE__URL=postgres_url, RELIABLE_CACHE__URL="none", RELIABLE_TRANSPORT__URL="memory://",
               RELIABLE_LOG__LEVEL="warning", PYTHONPATH=str(ROOT))
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.framework.lease_holder", unique, "m-1", str(marker), str(lease)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_until(lambda: marker.exists() or holder.poll() is not None)
        assert holder.poll() is None, holder.stderr.read() if holder.stderr else ""
        taken = time.time()
        wait_until(lambda: lease_expiry(postgres_url, unique, "m-1") > taken + lease)  # renewed while it runs
        time.sleep(random.uniform(0, lease))  # kill at a random moment of the renewal cycle
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
    assert holder.returncode == -signal.SIGKILL

    clock = FirstSleep()
    twin = test_app(tmp_path, clock=clock, store=postgres_url, cache="none")
    calls: list[str] = []

    @twin.handler("mail", group=unique, token="body.id", lease=lease)
    def send(msg: Message) -> str:
        calls.append(msg.body["id"])
        return "sent by twin"

    twin.publish("mail", {"id": "m-1"})
    twin.run(until_idle=True)
    assert calls == ["m-1"]
    stats = twin.stats()
    assert stats["deferred"] >= 1 and stats["processed"] == 1  # held at first, taken after expiry
    assert marker.read_text() == str(holder.pid)
    twin.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_renew_lease_moves_the_expiry_of_a_held_lease_only(tmp_path, request, unique, backend) -> None:
    clock = FakeClock()
    store = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    app = test_app(tmp_path, clock=clock, store=store)
    assert app.store.lease(unique, "t", 30.0).acquired
    clock.advance(20)
    assert app.store.renew_lease(unique, "t", 30.0)  # now expires at +50
    clock.advance(20)
    held = app.store.lease(unique, "t", 30.0)  # +40: the first lease alone would have expired at +30
    assert not held.acquired and held.expires_at == pytest.approx(clock.time() + 10)
    app.store.complete_lease(unique, "t", "done", 60.0)
    assert not app.store.renew_lease(unique, "t", 30.0)  # a DONE record is not a lease
    assert not app.store.renew_lease(unique, "other", 30.0)
    app.close()
