"""Two processes consuming the same tokens at the same time (real PostgreSQL and Redis).

Each process (`overlap_worker.py`) receives every token, one in order, the
other in reverse, so they work side by side and then meet in the middle,
where each finds the other's tokens claimed. Each handler call records its
process and its interval on PostgreSQL's clock: the test asserts that calls
of the two processes really overlapped in time, and that every token's side
effect is in PostgreSQL exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

ROOT = Path(__file__).resolve().parents[2]
COUNT = 400


@pytest.fixture
def tables(postgres_url: str, unique: str) -> Iterator[Engine]:
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null, pid integer not null)"))
        conn.execute(text(f"create table {unique}_calls (pid integer, token text, started timestamptz, "
                          "ended timestamptz)"))
        conn.execute(text(f"create table {unique}_ready (pid integer)"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text(f"drop table if exists {unique}, {unique}_calls, {unique}_ready"))
    engine.dispose()


def test_two_processes_consuming_the_same_tokens_overlap_and_each_effect_is_once(
    postgres_url: str, redis_url: str, tables: Engine, unique: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update(RELIABLE_STORE__URL=postgres_url, RELIABLE_CACHE__URL=redis_url,
               RELIABLE_TRANSPORT__URL="memory://", RELIABLE_LOG__LEVEL="warning", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.framework.overlap_worker", unique, str(COUNT), order],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for order in ("forward", "backward")]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    pids = {p.pid for p in procs}

    with tables.connect() as conn:
        effects: dict[str, int] = dict(conn.execute(text(f"select token, count(*) from {unique} group by token")).all())
        per_process: dict[int, int] = dict(conn.execute(text(f"select pid, count(*) from {unique}_calls group by pid")).all())
        overlapping = conn.execute(text(
            f"select count(*) from {unique}_calls a join {unique}_calls b "
            "on a.pid < b.pid and a.started < b.ended and b.started < a.ended")).scalar() or 0
    assert set(per_process) == pids and all(n > 0 for n in per_process.values()), per_process
    assert overlapping > 0, "no handler call of one process overlapped one of the other"
    assert effects == {f"t{i}": 1 for i in range(COUNT)}  # every token's effect exactly once
    assert sum(s["processed"] for s in stats) == COUNT  # each token processed by one process
    assert sum(s["duplicate"] for s in stats) == COUNT  # and found a duplicate by the other
