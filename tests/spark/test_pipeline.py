"""End to end: producers → broker server → Spark (the broker as a source) → PostgreSQL, under kills.

100,000 orders, 5% sent twice, 1% poison. The broker server is killed with
``kill -9`` once at a random point while the producers send (they resend
with their message ids), the Spark driver once at a random point while it
writes; both are started again. At the end PostgreSQL holds every valid
order exactly once and every poison order is in the dead-letter table
exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from examples.pipeline.produce import orders
from tests.broker.server.serving import ServerProcess
from tests.spark.conftest import ROOT

pytestmark = pytest.mark.spark
COUNT = 100_000
WAIT = 900.0


def child(log: Path, *args: str) -> subprocess.Popen[str]:
    """``python -m args...`` writing to ``log`` (a pipe nobody reads could stall it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT)


def counts(database, table: str) -> tuple[dict[str, int], dict[str, int]]:
    with database.connect() as connection:
        written = dict(connection.execute(text(f"select token, count(*) from {table} group by token")).all())
        poisoned = dict(connection.execute(text(
            f"select token, count(*) from {table}_dlq group by token")).all()) if _exists(connection, f"{table}_dlq") else {}
    return written, poisoned


def _written(database, table: str) -> int:  # type: ignore[no-untyped-def]
    with database.connect() as connection:
        if not _exists(connection, table):
            return 0
        return int(connection.execute(text(f"select count(*) from {table}")).scalar_one())


def _exists(connection, table: str) -> bool:  # type: ignore[no-untyped-def]
    return bool(connection.execute(text("select to_regclass(:t) is not null"), {"t": table}).scalar())


def test_producers_broker_spark_postgres_with_the_broker_and_the_driver_killed(tmp_path, postgres_url, unique):
    rng = random.Random()
    seed = rng.randrange(1_000_000)
    rng.seed(seed)
    print(f"seed {seed}")
    expected = orders(COUNT)
    valid = {o["token"] for o in expected if o["amount"] != "oops"}
    poison = {o["token"] for o in expected} - valid
    table = f"orders_{unique}"
    database = create_engine(postgres_url)
    server = ServerProcess(tmp_path / "broker").start()
    url = server.url
    producer = child(tmp_path / "producer.log", "examples.pipeline.produce", url, unique, str(COUNT))
    try:
        time.sleep(rng.uniform(0.5, 3.0))
        server.kill()  # mid-production: the producers' sends fail and are resent
        server = ServerProcess(tmp_path / "broker", port=server.port).start()
        assert producer.wait(timeout=WAIT) == 0, (tmp_path / "producer.log").read_text()[-5000:]

        job_args = ("examples.pipeline.job", url, unique, str(tmp_path / "checkpoint"), postgres_url,
                    "--max-rows", "20000", "--table", table)
        log = tmp_path / "driver.log"
        first = child(log, *job_args)
        deadline = time.monotonic() + WAIT
        while not _written(database, table):  # the driver is killed once it has written
            assert first.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 3.0))
        assert first.poll() is None, "the driver finished before it could be killed"
        first.send_signal(signal.SIGKILL)
        first.wait()
        for _ in range(3):  # restarted from its checkpoint until everything is in
            job = child(log, *job_args)
            assert job.wait(timeout=WAIT) == 0, log.read_text()[-5000:]
            written, poisoned = counts(database, table)
            if set(written) | set(poisoned) >= valid | poison:
                break
        assert written == dict.fromkeys(valid, 1)  # every valid order exactly once
        assert poisoned == dict.fromkeys(poison, 1)  # every poison order dead-lettered exactly once
    finally:
        producer.kill()
        server.stop()
        with database.begin() as connection:
            connection.execute(text(f"drop table if exists {table}"))
            connection.execute(text(f"drop table if exists {table}_dlq"))
        database.dispose()
