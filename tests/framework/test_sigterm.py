"""SIGTERM to a running ``reliable run`` worker: in-flight messages finish, acks are flushed, exit 0.

The handler marks each message when it starts and is slow, so SIGTERM lands
while one is in flight. After the exit every started message has its effect,
and a second worker finds exactly the rest: nothing acknowledged comes back.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.waiting import wait_until

APP = '''
import time
from pathlib import Path
from sqlalchemy import text
import reliable

app = reliable.App()

@app.handler("jobs", group="workers", token="body.token")
def work(msg, tx):
    Path("started", msg.body["token"]).touch()
    time.sleep(0.3)  # a slow job: SIGTERM lands while one is in flight
    tx.execute(text("create table if not exists done (token text)"))
    tx.execute(text("insert into done (token) values (:t)"), {"t": msg.body["token"]})

if __name__ == "__main__":
    app.publish_many("jobs", [{"token": f"j{n}"} for n in range(30)])
'''


def test_sigterm_finishes_in_flight_work_flushes_acks_and_exits_0(tmp_path: Path) -> None:
    (tmp_path / "jobs_app.py").write_text(APP)
    (tmp_path / "started").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update({"RELIABLE_TRANSPORT__URL": "embedded://./data/broker",
                "RELIABLE_STORE__URL": "sqlite:///./data/reliable.db", "RELIABLE_LOG__LEVEL": "warning"})
    subprocess.run([sys.executable, "jobs_app.py"], cwd=tmp_path, env=env, check=True, timeout=60)
    command = [str(Path(sys.executable).parent / "reliable"), "run", "jobs_app:app"]
    worker = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def three_started() -> bool:
        assert worker.poll() is None, "the worker exited before SIGTERM"
        return len(list((tmp_path / "started").iterdir())) >= 3

    wait_until(three_started, "three jobs started", 60)
    worker.send_signal(signal.SIGTERM)
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err[-3000:]
    started = {p.name for p in (tmp_path / "started").iterdir()}
    done = {row[0] for row in sqlite3.connect(tmp_path / "data/reliable.db").execute("select token from done")}
    assert started == done and 3 <= len(done) < 30  # the one in flight at SIGTERM finished
    first = json.loads(out.strip().splitlines()[-1])
    assert first["processed"] == len(done)

    rest = subprocess.run([*command, "--until-idle"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    second = json.loads(rest.stdout.strip().splitlines()[-1])
    assert (second["processed"], second["duplicate"]) == (30 - len(done), 0)  # no ack was lost
