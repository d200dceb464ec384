"""A Spark driver killed with SIGKILL after the sink wrote and before Spark's checkpoint recorded the batch.

The driver (`tests/spark/driver_child.py`, a process of its own) holds inside
the batch function right after the wrapper committed a randomly chosen batch;
the test checks the rows are in PostgreSQL and the checkpoint has no commit
for that batch, kills the driver with ``kill -9`` and restarts it from the
checkpoint: Spark replays the batch, the fence skips it, every order is
written once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.spark.conftest import ROOT
from tests.spark.streams import order, write_orders

pytestmark = pytest.mark.spark

BATCHES = [
    [order("o1"), order("o2")],
    [order("o2", note="dup across"), order("o3"), order("o3", note="dup in batch")],
    [order("o4"), order("o1", note="dup across")],
    [order("o5"), order("o6")],
]
WAIT = 300.0


def _driver(tmp_path: Path, store: str, table: str, sink: str, hold_after: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [tmp_path / "in", tmp_path / "checkpoint", store, table, sink, hold_after, tmp_path]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.spark.driver_child", *map(str, args)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_for(marker: Path, driver: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT
    while not marker.exists():
        if driver.poll() is not None:
            pytest.fail(f"the driver ended before {marker.name}:\n{driver.stdout.read()[-5000:]}")
        assert time.monotonic() < deadline, f"no {marker.name} within {WAIT} s"
        time.sleep(0.1)


def _reports(tmp_path: Path, pid: int) -> list[tuple[int, str]]:
    lines = (tmp_path / f"report-{pid}.jsonl").read_text().splitlines()
    return [(entry["batch_id"], entry["status"]) for entry in map(json.loads, lines)]


@pytest.mark.parametrize("sink", ["any", "store"])
def test_a_driver_killed_between_the_sink_write_and_the_checkpoint_writes_each_row_once(
    tmp_path, postgres_url, unique, sink
):
    seed = random.randrange(1_000_000)
    held = random.Random(seed).randrange(len(BATCHES))
    print(f"seed {seed}: the driver is killed after batch {held} wrote")
    for number, rows in enumerate(BATCHES):
        write_orders(tmp_path / "in", str(number), rows)
    database = create_engine(postgres_url)
    with database.begin() as connection:
        connection.execute(text(f"CREATE TABLE {unique} (order_id TEXT, amount BIGINT, note TEXT)"))
    try:
        first = _driver(tmp_path, postgres_url, unique, sink, held)
        _wait_for(tmp_path / f"written-{held}", first)
        written = _orders(database, unique)
        expected_so_far = sorted({row["order_id"] for rows in BATCHES[: held + 1] for row in rows})
        assert written == expected_so_far  # the sink wrote batch `held` ...
        assert not (tmp_path / "checkpoint" / "commits" / str(held)).exists()  # ... Spark did not record it
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=60) == -signal.SIGKILL

        second = _driver(tmp_path, postgres_url, unique, sink, -1)
        output, _ = second.communicate(timeout=WAIT)
        assert second.returncode == 0, output[-5000:]
        restarted = _reports(tmp_path, second.pid)
        assert restarted[0] == (held, "replayed")  # Spark ran the batch again; the fence skipped it
        assert [batch for batch, _ in restarted] == list(range(held, len(BATCHES)))
        assert _orders(database, unique) == ["o1", "o2", "o3", "o4", "o5", "o6"]
        assert _count(database, unique) == 6  # each order once, not only each order present
    finally:
        with database.begin() as connection:
            connection.execute(text(f"DROP TABLE IF EXISTS {unique}"))
        database.dispose()


def _orders(database, table: str) -> list[str]:
    with database.connect() as connection:
        return sorted(set(connection.execute(text(f"SELECT order_id FROM {table}")).scalars()))


def _count(database, table: str) -> int:
    with database.connect() as connection:
        return int(connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
