"""SIGTERM to a real ``reliable run`` worker under the batch commit strategy: pending acks are
flushed, the process exits 0, and nothing it did comes back afterwards.

Embedded broker (shared on disk with the test), PostgreSQL store, batch commit
strategy with a long interval, so acks really are pending when the signal lands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

from reliable import Message
from reliable.testing import test_app
from tests.transports.effects import effect_counts
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_finishes_in_flight_flushes_acks_and_exits_0(tmp_path, postgres_url, unique) -> None:
    broker = f"embedded://{tmp_path / 'broker'}"
    settings = {"RELIABLE_TRANSPORT__URL": broker, "RELIABLE_STORE__URL": postgres_url, "RELIABLE_CACHE__URL": "none"}
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"create table {unique} (token text not null)"))
    engine.dispose()
    ids = [f"m{i}" for i in range(5)] + ["hold"] + [f"m{i}" for i in range(5, 40)]
    publisher = test_app(tmp_path, settings=settings)
    publisher.publish_many("work", [{"id": i} for i in ids], message_ids=ids)
    publisher.close()

    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update(settings, RELIABLE_COMMIT__STRATEGY="batch", RELIABLE_COMMIT__INTERVAL="3600",
               RELIABLE_LOG__LEVEL="warning", SIGTERM_TABLE=unique, SIGTERM_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    worker = subprocess.Popen(
        [sys.executable, "-m", "reliable.cli", "run", "tests.framework.sigterm_app:app"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        def in_flight() -> bool:
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
            return (tmp_path / "in-flight").exists()

        wait_until(in_flight, "the held message in its handler", 60)
        worker.send_signal(signal.SIGTERM)  # while "hold" is in its handler, its neighbours' acks pending
        (tmp_path / "release").touch()
        _out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    assert worker.returncode == 0, err

    done = effect_counts(postgres_url, unique)
    assert done.get("hold") == 1  # the message in flight was finished, not abandoned
    assert set(done.values()) == {1}

    after = test_app(tmp_path, settings=settings)
    seen: list[str] = []

    @after.handler("work", group=unique, token="body.id")
    def work(msg: Message, tx) -> None:
        seen.append(msg.body["id"])
        tx.execute(text(f"insert into {unique} (token) values (:t)"), {"t": msg.body["id"]})

    after.run(until_idle=True)
    assert after.stats()["duplicate"] == 0  # nothing the stopped worker did came back
    assert sorted(seen) == sorted(set(ids) - set(done))
    assert effect_counts(postgres_url, unique) == {i: 1 for i in ids}
    after.close()
