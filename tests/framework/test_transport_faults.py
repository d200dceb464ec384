"""The transport contract under faults: consumer-kept offsets across kill -9, an outage
mid-run, and dead-letter replays that reach the failing group only.

Real PostgreSQL store, real Redis Streams transport; the kill test runs real
worker processes (`offsets_worker.py`) and kills them with SIGKILL.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from sqlalchemy import Engine, create_engine, text

from backends.clock import SYSTEM_CLOCK
from backends.errors import TransportError
from backends.store import open_store
from reliable import Message
from reliable.testing import test_app
from tests import forked
from tests.framework import offsets_worker
from tests.tcp_proxy import TcpProxy
from tests.transports.effects import wait_until
from tests.transports.kill_points import JITTER, held_back, points

ROOT = Path(__file__).resolve().parents[2]
RUNS = 20


@pytest.fixture
def saves(postgres_url: str, unique: str) -> Iterator[str]:
    """An effects table, and a trigger recording every save of ``unique``'s offsets (old -> new)."""
    open_store(postgres_url).close()  # the store's tables exist
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null)"))
        conn.execute(text(f"create table {unique}_saves (queue int, old bigint, new bigint)"))
        conn.execute(text(f"""
            create function {unique}_record() returns trigger language plpgsql as $$
            begin
              if NEW."group" = '{unique}' then
                insert into {unique}_saves values (NEW.queue,
                  case when TG_OP = 'UPDATE' then OLD.next_offset end, NEW.next_offset);
              end if;
              return NEW;
            end $$"""))
        conn.execute(text(f"create trigger {unique}_record before insert or update on reliable_offsets "
                          f"for each row execute function {unique}_record()"))
    yield unique
    with engine.begin() as conn:
        conn.execute(text(f"drop trigger if exists {unique}_record on reliable_offsets"))
        conn.execute(text(f"drop function if exists {unique}_record()"))
        conn.execute(text(f"drop table if exists {unique}, {unique}_saves"))
    engine.dispose()


@functools.cache
def _engine(postgres_url: str) -> Engine:
    """One engine for the test's polls (every 5 ms): a new one per poll made PostgreSQL start a backend each time."""
    return create_engine(postgres_url, pool_size=1)


def _rows(postgres_url: str, sql: str) -> list[tuple]:
    with _engine(postgres_url).begin() as conn:
        return [tuple(row) for row in conn.execute(text(sql))]


def test_transactional_offsets_survive_kill_9(tmp_path: Path, postgres_url: str, redis_url: str, saves: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update(
        RELIABLE_STORE__URL=postgres_url,
        RELIABLE_CACHE__URL="memory://",
        # leases far longer than the test: a restart must resume from the saved offsets
        RELIABLE_TRANSPORT__URL=f"{redis_url}?namespace={saves}",
        RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT="600",
        RELIABLE_LOG__LEVEL="info",
        PYTHONPATH=str(ROOT),
    )
    tokens = [f"t{i}" for i in range(1800)]
    sent = tokens + random.Random(7).sample(tokens, 200)  # 10% duplicates
    random.Random(8).shuffle(sent)
    head, tail = held_back(sent)  # the tail published only after the last kill: no kill after the work
    producer = test_app(store=postgres_url, transport=f"{redis_url}?namespace={saves}")
    producer.publish_many("work", [{"token": t} for t in head])

    def done() -> int:
        return int(_rows(postgres_url, f"select count(*) from {saves}")[0][0])

    rng, resumed, work = random.Random(), 0, len(set(head))
    landed: list[int] = []  # the progress after each kill
    try:
        for run, point in enumerate(points(RUNS, work, rng)):  # a random point of the work, mid-run
            target = min(max(point, done() + 1), work)  # and after some work of this worker's
            # forked from a process that imported the worker already (`tests.forked`): no second of imports per run
            log = tmp_path / f"worker-{run}.log"
            worker = forked.start(offsets_worker.main, (saves,), env, ROOT, log)
            try:
                wait_until(lambda: done() >= target, worker.is_alive, 0.005)  # noqa: B023
                time.sleep(rng.uniform(0, JITTER))  # and at a random moment after it
            finally:  # a failed wait must not leave a worker consuming after the test
                worker.kill()
            worker.join(timeout=60)
            assert worker.exitcode == -signal.SIGKILL, "the kills must land while workers run"
            landed.append(done())  # at least what it was at the kill
            resumed += "offsets_resumed" in log.read_text()
        producer.publish_many("work", [{"token": t} for t in tail])  # only now can the work end
    finally:
        producer.close()
    final = subprocess.run([sys.executable, "-m", "tests.framework.offsets_worker", saves],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]

    assert len(landed) == RUNS and all(n < len(tokens) for n in landed), "the kills must land while workers run"
    print(f"offsets kill -9: {sum(n < work for n in landed)} of {RUNS} kills with work published left, at {landed}")
    assert resumed >= 1, "restarted workers resumed from the offsets saved with the tokens"
    counts = dict(_rows(postgres_url, f"select token, count(*) from {saves} group by token"))
    assert counts == dict.fromkeys(tokens, 1), final.stderr[-4000:]  # every token's effect exactly once
    moves = _rows(postgres_url, f"select queue, old, new from {saves}_saves")
    assert moves, "offsets were saved"
    assert [m for m in moves if m[1] is not None and m[2] < m[1]] == []  # never backwards


def test_transport_cut_mid_run_reconnects_and_loses_nothing(tmp_path, redis_url: str, unique: str) -> None:
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    proxy = TcpProxy(host, int(port))
    app = test_app(tmp_path, clock=SYSTEM_CLOCK, transport=f"redis://127.0.0.1:{proxy.port}/0?namespace={unique}",
                   settings={"RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": "2"})
    done: list[str] = []
    cut = threading.Event()

    @app.handler("orders", token="body.id")
    def handle(msg: Message, tx) -> None:
        done.append(msg.body["id"])
        if len(done) == 100 and not cut.is_set():
            cut.set()
            proxy.cut()
            threading.Timer(1.0, proxy.restore).start()

    app.publish_many("orders", [{"id": f"o{i}"} for i in range(300)])
    with structlog.testing.capture_logs() as logs:
        app.run(until_idle=True)
    proxy.close()
    events = [entry["event"] for entry in logs]
    assert cut.is_set() and "transport_unavailable" in events and "transport_reconnected" in events
    assert sorted(set(done)) == sorted(f"o{i}" for i in range(300))  # nothing lost
    assert app.stats()["processed"] == 300  # nothing processed twice (copies are duplicates)
    app.close()


def test_a_replayed_dead_letter_reaches_only_its_group(tmp_path) -> None:
    app = test_app(tmp_path, settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "0"})
    seen: dict[str, list[str]] = {"billing": [], "audit": []}
    broken = {"billing": True}

    @app.handler("payments", group="billing", token="body.id")
    def billing(msg: Message, tx) -> None:
        if broken["billing"]:
            raise ValueError("billing is down")
        seen["billing"].append(msg.body["id"])

    @app.handler("payments", group="audit", token="body.id")
    def audit(msg: Message, tx) -> None:
        seen["audit"].append(msg.body["id"])

    app.publish("payments", {"id": "p1"})
    app.run(until_idle=True)
    (letter,) = app.dead_letters("billing")
    assert seen == {"billing": [], "audit": ["p1"]}
    broken["billing"] = False
    assert app.replay_dead_letters("billing") == 1
    app.run(until_idle=True)
    assert seen == {"billing": ["p1"], "audit": ["p1"]}  # audit did not see the replay
    assert app.dead_letters("billing") == [] and letter.message.topic == "payments"
    app.close()


@pytest.mark.parametrize("error", [TransportError("message 'm' is not held by this member"),
                                   TypeError("a bug of ours")], ids=["own check", "bug"])
def test_an_ack_failing_on_a_check_or_a_bug_of_ours_still_ends_the_run(tmp_path, monkeypatch, error) -> None:
    """An ack or commit the server refused leaves the group and goes on; a refusal raised by a check
    of our own (no client library's error as its cause) or any other error of our code does not."""
    app = test_app(tmp_path)

    @app.handler("orders", group="shipping")
    def ship(msg: Message, tx) -> None:
        pass

    def failing(group: str, messages: object) -> None:
        raise error

    app.publish("orders", {"n": 1})
    monkeypatch.setattr(app.transport, "_ack", failing)
    with pytest.raises(type(error), match=str(error)):
        app.run(until_idle=True)
    app.close()
