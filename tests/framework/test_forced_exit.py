"""Ctrl-C: the first logs that shutdown started; a second forces the exit, logging what it hands back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from sqlalchemy import text

from reliable.testing import test_app

ROOT = Path(__file__).resolve().parents[2]


def test_second_ctrl_c_forces_the_exit_and_hands_the_messages_back(tmp_path) -> None:
    store = f"sqlite:///{tmp_path / 'store.db'}"
    settings = {"RELIABLE_TRANSPORT__URL": f"embedded://{tmp_path / 'broker'}", "RELIABLE_STORE__URL": store,
                "RELIABLE_CACHE__URL": "none"}
    publisher = test_app(tmp_path, settings=settings)
    with publisher.store.transaction() as tx:
        tx.execute(text("create table forced (token text not null)"))
    ids = ["hold", "m1", "m2"]
    publisher.publish_many("work", [{"id": i} for i in ids], message_ids=ids)
    publisher.close()

    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update(settings, RELIABLE_LOG__LEVEL="warning", RELIABLE_LOG__FORMAT="json", SIGTERM_TABLE="forced",
               SIGTERM_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    worker = subprocess.Popen([sys.executable, "-m", "reliable.cli", "run", "tests.framework.sigterm_app:app"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert worker.stdout is not None
    events: list[dict] = []

    def read_until(event: str) -> dict:
        for line in worker.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                events.append(json.loads(line))
                if events[-1]["event"] == event:
                    return events[-1]
        raise AssertionError(f"the worker ended without logging {event}: {events}")

    try:
        while not (tmp_path / "in-flight").exists():  # "hold" is in its handler, which never returns
            try:
                worker.wait(0.01)
            except subprocess.TimeoutExpired:
                continue
            raise AssertionError(f"the worker ended early: {worker.stdout.read()}")
        worker.send_signal(signal.SIGINT)
        started = read_until("shutdown_started")
        worker.send_signal(signal.SIGINT)
        forced = read_until("shutdown_forced")
        assert worker.wait(60) == 128 + signal.SIGINT
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert started["signal"] == "SIGINT" and started["in_hand"] == 3
    assert forced["handed_back"] == 3
    assert "worker_stopped" not in [e["event"] for e in events]  # no graceful stop: a cold one
    rest = test_app(tmp_path, settings=settings)  # nothing was acked: all three come back
    with rest.transport.subscribe("forced", ["work"]) as member:
        assert member.pending() == 3
    rest.close()


SECOND_CTRL_C_MID_LOG = """
import io, os, signal, sys
from reliable.log import configure_logging
from reliable.testing import test_app

class SecondCtrlCMidLine(io.TextIOBase):
    # a second Ctrl-C lands while the first one's log line is being written (the logger's lock held)
    def write(self, text):
        sys.__stdout__.write(text)
        sys.__stdout__.flush()
        if '"shutdown_started"' in text:
            os.kill(os.getpid(), signal.SIGINT)
        if '"worker_started"' in text:
            os.kill(os.getpid(), signal.SIGINT)
        return len(text)

configure_logging("info", "json", SecondCtrlCMidLine())
app = test_app(sys.argv[1])

@app.handler("work")
def handle(msg):
    pass

app.run()
"""


def test_a_second_ctrl_c_during_a_log_line_still_forces_the_exit(tmp_path) -> None:
    """The first Ctrl-C's log line was written from the signal handler: a second one landing while
    it was being written logged from a handler nested in it and waited forever on the logger's lock."""
    run = subprocess.run([sys.executable, "-c", SECOND_CTRL_C_MID_LOG, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    events = [json.loads(line)["event"] for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 128 + signal.SIGINT, run.stderr[-2000:]
    # other threads (the relay's start) may log between the two
    assert [e for e in events if e.startswith("shutdown_")] == ["shutdown_started", "shutdown_forced"]
