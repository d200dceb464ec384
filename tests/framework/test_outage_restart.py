"""A store outage during which the worker is killed (kill -9) and restarted, for real.

PostgreSQL behind `tests.tcp_proxy`, the broker server (``reliable://``),
worker processes (`tests.framework.outage_worker`). Deliveries that only
waited out the outage are no attempts of the message's: after the outage,
its first transient failure is redelivered, not dead-lettered, although the
worker that counted the deferrals died during the outage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import create_engine, text

from backends.store.sqlalchemy import SqlStore
from reliable import App
from reliable.settings import Settings
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until

MAX_REDELIVERIES = 3


class WorkerProcess:
    """One `outage_worker` process, its JSON log in a file."""

    def __init__(self, log: Path, env: dict[str, str], table: str) -> None:
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.framework.outage_worker", table],
                                            env=env, stdout=out, stderr=subprocess.STDOUT)

    def logged(self, event: str) -> int:
        return self.log.read_text().count(f'"event": "{event}"')

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def test_a_restart_during_a_store_outage_does_not_spend_the_messages_redeliveries(
    tmp_path: Path, reliable_server, postgres_url: str, postgres_proxy: TcpProxy, unique: str
) -> None:
    parts = urlsplit(postgres_url)
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{postgres_proxy.port}"))
    settings = {"RELIABLE_TRANSPORT__URL": reliable_server.url, "RELIABLE_CACHE__URL": "memory://",
                "RELIABLE_RETRY__INITIAL_DELAY": "0.1", "RELIABLE_RETRY__JITTER": "0",
                "RELIABLE_RETRY__MAX_REDELIVERIES": str(MAX_REDELIVERIES),
                "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"}
    env = {**os.environ, **settings, "RELIABLE_STORE__URL": proxied, "RELIABLE_OUTBOX__RELAY": "false",
           "RELIABLE_LOG__FORMAT": "json", "RELIABLE_LOG__LEVEL": "info"}
    direct = create_engine(postgres_url)
    store = SqlStore(postgres_url)
    with direct.begin() as connection:
        connection.execute(text(f"create table {unique} (token text, attempt integer)"))
    store.count_dead_letters(unique)  # the store's tables exist before the outage
    publisher = App(Settings.load(None, env={**settings, "RELIABLE_STORE__URL": postgres_url}))
    publisher.handler(unique, group=unique, token="body.token")(lambda msg, tx: None)  # declares the group
    first = WorkerProcess(tmp_path / "first.log", env, unique)
    second: WorkerProcess | None = None
    try:
        wait_until(lambda: first.logged("group_joined"), "the first worker to join its group")
        postgres_proxy.cut()
        publisher.publish(unique, {"token": "t1"})
        wait_until(lambda: first.logged("store.unavailable") >= 6, "the first worker to meet the outage a while")
        deferred_before_restart = first.logged("message_deferred")
        first.kill()
        second = WorkerProcess(tmp_path / "second.log", env, unique)
        wait_until(lambda: second.logged("store.unavailable") >= 3, "the restarted worker to meet the outage")
        deferred_after_restart = second.logged("message_deferred")
        postgres_proxy.restore()
        wait_until(lambda: rows(direct, unique) or store.count_dead_letters(unique), "the message to be settled")
    finally:
        first.kill()
        if second is not None:
            second.kill()
        publisher.close()
    deliveries = [(e["event"], e.get("attempt")) for e in events(first.log) + events(second.log)
                  if "attempt" in e]
    assert store.count_dead_letters(unique) == 0, deliveries
    # one delivery deferred when the outage was found, none after the restart (the store was
    # still down), the transient failure redelivered, then done
    assert (deferred_before_restart, deferred_after_restart) == (1, 0), deliveries
    assert rows(direct, unique) == [("t1", 3)], deliveries
    store.close()
    direct.dispose()


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def rows(engine, table: str) -> list[tuple[str, int]]:
    with engine.connect() as connection:
        return [(t, a) for t, a in connection.execute(text(f"select token, attempt from {table}"))]
