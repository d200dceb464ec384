"""Exactly one side effect per token: concurrent twins, two processes, kill -9 mid-batch.

Real PostgreSQL store, real Redis cache; the two-process and kill tests run
real worker processes (`worker_process.py`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from reliable import Message
from reliable.testing import test_app
from tests.transports.effects import effect_counts, query, wait_until
from tests.transports.kill_points import HELD_BACK, JITTER, points

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def effects_table(postgres_url: str, unique: str) -> Iterator[str]:
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null, pid integer)"))
    yield unique
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}"))
    engine.dispose()


def test_eight_threads_one_effect_per_token(tmp_path, postgres_url, redis_url, effects_table, unique) -> None:
    app = test_app(tmp_path, store=postgres_url, cache=redis_url)

    @app.handler("work", group=unique, token="body.token", concurrency=8, prefetch=64)
    def handle(msg: Message, tx) -> None:
        tx.execute(text(f"insert into {effects_table} (token) values (:t)"), {"t": msg.body["token"]})
        time.sleep(0.001)  # hold the transaction so twins overlap on the unique index

    tokens = [f"t{i}" for i in range(60)]
    app.publish_many("work", [{"token": t} for _ in range(8) for t in tokens])  # 8 copies, no key: spread
    app.run(until_idle=True)

    assert effect_counts(postgres_url, effects_table) == {t: 1 for t in tokens}
    stats = app.stats()
    assert stats["processed"] == 60 and stats["duplicate"] == 7 * 60
    app.close()


def _env(postgres_url: str, redis_url: str, transport: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update(
        RELIABLE_STORE__URL=postgres_url,
        RELIABLE_CACHE__URL=redis_url,
        RELIABLE_TRANSPORT__URL=transport,
        RELIABLE_LOG__LEVEL="warning",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


def _worker(table: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.framework.worker_process", table, *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_two_processes_sending_the_same_tokens(tmp_path, postgres_url, redis_url, effects_table, unique) -> None:
    env = _env(postgres_url, redis_url, "memory://", RELIABLE_WORKER__CONCURRENCY="4")
    env["RELIABLE_CACHE__URL"] = redis_url
    # each process has its own in-memory transport and receives all 300 tokens: every token twice overall
    procs = [_worker(effects_table, "publish", "300", "consume", env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert effect_counts(postgres_url, effects_table) == {f"t{i}": 1 for i in range(300)}
    assert sum(s["processed"] for s in stats) == 300
    assert sum(s["duplicate"] for s in stats) == 300


def test_kill_9_mid_batch_loses_nothing_and_repeats_nothing(tmp_path, postgres_url, redis_url, effects_table) -> None:
    """Three workers killed one after another mid-batch, at random points of the work
    (`tests.transports.kill_points`: the last tokens are published only after the last kill), each
    after some work of its own; a last worker finishes. Every token's effect once."""
    broker = f"embedded://{tmp_path / 'broker'}"
    env = _env(postgres_url, redis_url, broker, RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT="1.0")
    total = 1500
    work = total - HELD_BACK

    def publish(tokens: str) -> None:
        publisher = _worker(effects_table, "publish", tokens, env=env)
        assert publisher.wait(timeout=120) == 0, publisher.stderr.read() if publisher.stderr else ""

    def done() -> int:
        return int(query(postgres_url, f"select count(*) from {effects_table}")[0][0])

    publish(str(work))
    rng, landed = random.Random(), []  # the progress after each kill
    for point in points(3, work, rng):  # kill three workers at different points, mid-batch
        target = min(max(point, done() + 1), work)  # and after some work of this worker's
        worker = _worker(effects_table, "consume", "50", env=env)
        try:
            wait_until(lambda: done() >= target, lambda: worker.poll() is None, 0.02)  # noqa: B023
            time.sleep(rng.uniform(0, JITTER))  # and at a random moment after it
        finally:  # a failed wait must not leave a worker consuming after the test
            worker.kill()
        worker.wait(timeout=30)
        assert worker.returncode == -signal.SIGKILL
        landed.append(done())  # at least what it was at the kill
    assert len(landed) == 3 and all(n < total for n in landed), "the kills landed while work was in progress"
    print(f"kill -9 mid-batch: {sum(n < work for n in landed)} of 3 kills with work published left, at {landed}")
    publish(f"{work}:{total}")  # only now can the work end

    survivor = _worker(effects_table, "consume", "50", env=env)
    _out, err = survivor.communicate(timeout=240)
    assert survivor.returncode == 0, err
    assert effect_counts(postgres_url, effects_table) == {f"t{i}": 1 for i in range(total)}
