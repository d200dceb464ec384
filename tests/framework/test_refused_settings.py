"""A server refusing the settings (a wrong login, a database that does not exist) is a clear
error, not an outage waited out for ever; an outage is still waited out; a refusal after the
store worked (a role locked mid-run) is waited out too, logged as a refusal.

Real PostgreSQL throughout: a database and a role that do not exist, a role of the test's own
that is locked and unlocked, and `tests.tcp_proxy` for a store that is down from the start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from sqlalchemy import create_engine, text
from structlog.testing import capture_logs

from reliable import App, Message
from reliable.errors import BackendRefusedError
from reliable.health import readiness
from reliable.settings import Settings
from tests.cluster.ports import free_ports
from tests.framework.refusals import Running, reliable_cmd, run_through_outage, said
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until

APP_MODULE = '''
import reliable

app = reliable.App()

@app.handler("orders", group="shipping")
def ship(msg, tx):
    pass
'''

COMMANDS = {
    "run --until-idle": ["run", "orders_app:app", "--until-idle"],
    "run": ["run", "orders_app:app"],
    "relay": ["relay"],
    "dlq list": ["dlq", "list", "shipping"],
    "dlq replay": ["dlq", "replay", "shipping"],
    "outbox status": ["outbox", "status"],
}


def with_path(url: str, user: str | None = None, database: str | None = None, port: int | None = None) -> str:
    """``url`` with another user, database or port."""
    parts = urlsplit(url)
    host = f"{user or parts.username}@{parts.hostname}:{port or parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=host, path=f"/{database}" if database else parts.path))


REFUSALS = [*((command, "database") for command in COMMANDS), ("run --until-idle", "role"), ("dlq list", "role")]
"""Every command meets a database that does not exist; two meet a role that does not exist."""


@pytest.mark.parametrize(("command", "refused"), REFUSALS)
def test_each_command_stops_with_the_setting_and_the_servers_words(tmp_path: Path, postgres_url: str,
                                                                     command: str, refused: str) -> None:
    url = with_path(postgres_url, database="nosuchdb") if refused == "database" else with_path(
        postgres_url, user="nosuchrole")
    (tmp_path / "orders_app.py").write_text(APP_MODULE)
    (tmp_path / "reliable.toml").write_text(f'[transport]\nurl = "embedded://./broker"\n[store]\nurl = "{url}"\n')

    done = reliable_cmd(tmp_path, *COMMANDS[command])

    assert done.returncode == 2, done.stderr
    lines = said(done)
    assert len(lines) == 1 and lines[0].startswith(f"error: [store] url = '{url}': the server refused it: "), lines
    assert ('database "nosuchdb" does not exist' if refused == "database" else 'role "nosuchrole" does not exist') in lines[0]
    assert "Traceback" not in done.stderr


def make_app(store: str, broker: Path, seen: list[str] | None = None, mode: str = "single") -> App:
    """An app whose handler of "orders" notes each order in ``seen``: one message a transaction
    (``single``), ten (``batch``), or ``async def`` on the async engine (``async``)."""
    env = {"RELIABLE_STORE__URL": store, "RELIABLE_TRANSPORT__URL": f"embedded://{broker}",
           "RELIABLE_RETRY__INITIAL_DELAY": "0.05"}
    app = App(Settings.load(None, env=env))
    noted = seen if seen is not None else []
    if mode == "batch":
        @app.handler("orders", group="shipping", batch=10)
        def ship_batch(messages: list[Message], tx: Any) -> None:
            noted.extend(m.body["order"] for m in messages)
    elif mode == "async":
        @app.handler("orders", group="shipping")
        async def ship_async(msg: Message, tx: Any) -> None:
            noted.append(msg.body["order"])
    else:
        @app.handler("orders", group="shipping")
        def ship(msg: Message, tx: Any) -> None:
            noted.append(msg.body["order"])
    return app


@pytest.mark.parametrize("mode", ["single", "batch", "async"])
def test_a_message_in_hand_when_the_store_refuses_is_not_dead_lettered(tmp_path: Path, postgres_url: str,
                                                                      mode: str) -> None:
    refused = make_app(with_path(postgres_url, database="nosuchdb"), tmp_path / "broker", mode=mode)
    refused.publish("orders", {"order": "o-1"})
    run = Running(refused, until_idle=True)
    run.join()
    refused.close()
    assert isinstance(run.error, BackendRefusedError), run.error
    assert run.error.setting.startswith("[store] url")

    seen: list[str] = []
    fixed = make_app(f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "broker", seen, mode)
    fixed.run(until_idle=True)
    assert seen == ["o-1"]
    assert fixed.dead_letters("shipping") == []
    assert fixed.stats()["dead_lettered"] == 0
    fixed.close()


@pytest.mark.parametrize("mode", ["single", "async"])
def test_a_store_down_from_the_start_is_waited_out(tmp_path: Path, postgres_url: str, mode: str) -> None:
    parts = urlsplit(postgres_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    proxy.cut()
    seen: list[str] = []
    app = make_app(with_path(postgres_url, port=proxy.port), tmp_path / "broker", seen, mode)
    app.publish("orders", {"order": "o-1"})
    with capture_logs() as logs:
        run_through_outage(app, lambda: sum(e["event"] == "store.unavailable" for e in logs) >= 3,
                           "the store tried three times", proxy.restore)
    assert seen == ["o-1"]
    app.close()
    proxy.close()


@pytest.fixture
def role(postgres_url: str, unique: str) -> Iterator[Callable[[str], None]]:
    """A login role of the test's own; call it with a statement's tail ("NOLOGIN", "LOGIN") to alter it."""
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f"CREATE ROLE {unique} SUPERUSER LOGIN"))

    def alter(change: str) -> None:
        with admin.connect() as c:
            c.execute(text(f"ALTER ROLE {unique} {change}"))
            c.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"), {"r": unique})

    yield alter
    with admin.connect() as c:
        c.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"), {"r": unique})
        c.execute(text(f"REASSIGN OWNED BY {unique} TO CURRENT_USER"))
        c.execute(text(f"DROP OWNED BY {unique}"))
        c.execute(text(f"DROP ROLE {unique}"))
    admin.dispose()


@pytest.mark.parametrize("mode", ["single", "async"])
def test_a_refusal_after_the_store_worked_is_waited_out_as_an_error(tmp_path: Path, postgres_url: str, unique: str,
                                                                    role: Callable[[str], None], mode: str) -> None:
    seen: list[str] = []
    app = make_app(with_path(postgres_url, user=unique), tmp_path / "broker", seen, mode)
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"order": "o-1"})
        wait_until(lambda: seen == ["o-1"], "the first order handled")

        role("NOLOGIN")  # and its connections ended: the next one is refused
        app.publish("orders", {"order": "o-2"})
        refusal = wait_until(lambda: next((e for e in logs if e["event"] == "backend_refused"), None),
                             "the refusal logged")
        assert refusal["log_level"] == "error"
        assert refusal["setting"].startswith("[store] url") and "not permitted to log in" in refusal["error"]
        assert readiness(app)["store"] is False
        assert run.thread.is_alive() and seen == ["o-1"]

        role("LOGIN")
        wait_until(lambda: seen == ["o-1", "o-2"], "the second order handled once the role may log in again")
        app.stop()
        run.join()
    assert run.error is None, run.error
    assert app.dead_letters("shipping") == []
    app.close()


@pytest.fixture(scope="module")
def password_postgres() -> Iterator[str]:
    """A PostgreSQL cluster of the test's own that asks for a password (scram-sha-256; the
    shared one trusts every login): user postgres, password ``right``; its URL without one."""
    initdb = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    assert initdb, "initdb is not installed (apt-get install postgresql)"
    binaries = initdb[-1].parent
    folder = Path(tempfile.mkdtemp(prefix="reliable-pg-"))  # not under pytest's root-only folder
    (folder / "password").write_text("right\n")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # initdb refuses root
    if as_postgres:
        for path in (folder, folder / "password"):
            shutil.chown(path, "postgres")
    port = free_ports(1)[0]
    data = str(folder / "data")
    subprocess.run([*as_postgres, str(binaries / "initdb"), "-D", data, "--auth=scram-sha-256", "-U", "postgres",
                    f"--pwfile={folder / 'password'}"], check=True, capture_output=True, timeout=120)
    subprocess.run([*as_postgres, str(binaries / "pg_ctl"), "-D", data, "-l", str(folder / "log"), "-w", "start",
                    "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1"], check=True, capture_output=True,
                   timeout=120)
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_postgres, str(binaries / "pg_ctl"), "-D", data, "-m", "immediate", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(("password", "words"), [
    ("wrong", 'password authentication failed for user "postgres"'),  # 28P01, from the server
    (None, "no password supplied"),  # libpq's: the server asked for one, the URL has none
])
def test_a_password_the_server_refuses_stops_the_run(tmp_path: Path, password_postgres: str, password: str | None,
                                                     words: str) -> None:
    parts = urlsplit(password_postgres)
    url = password_postgres if password is None else urlunsplit(
        parts._replace(netloc=f"postgres:{password}@{parts.hostname}:{parts.port}"))
    (tmp_path / "orders_app.py").write_text(APP_MODULE)
    (tmp_path / "reliable.toml").write_text(f'[transport]\nurl = "embedded://./broker"\n[store]\nurl = "{url}"\n')

    done = reliable_cmd(tmp_path, "run", "orders_app:app", "--until-idle")

    assert done.returncode == 2, done.stderr
    lines = said(done)
    assert len(lines) == 1 and lines[0].startswith("error: [store] url = 'postgresql+psycopg://postgres"), lines
    assert words in lines[0] and "wrong" not in lines[0]  # the password is never shown
