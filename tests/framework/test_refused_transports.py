"""A transport or cache server refusing the URL's login (or its RabbitMQ virtual host) stops
`reliable run` and `reliable relay` with the setting named; an outage is still waited out.

Real servers: RabbitMQ (guest/guest: a wrong password, a vhost that does not exist), Redis
(an ACL user of the test's own, given a wrong password), a ``nats-server`` the test starts
with a user and password, and the project's broker server with a user.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import pytest
import redis
from structlog.testing import capture_logs

from backends.store import open_store
from backends.transport.amqp_transport import AmqpTransport
from reliable import App, Message
from reliable.errors import BackendRefusedError
from reliable.settings import Settings
from tests.broker.server.serving import ServerProcess
from tests.cluster.ports import free_ports, wait_listening
from tests.framework.refusals import Running, reliable_cmd, run_through_outage, said
from tests.passwords import hash_password
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until

APP_MODULE = '''
import reliable

app = reliable.App()

@app.handler("orders", group="shipping")
def ship(msg, tx):
    pass
'''


def with_login(url: str, user: str, password: str, path: str | None = None, port: int | None = None) -> str:
    """``url`` logging in as ``user`` with ``password`` (another path, another port)."""
    parts = urlsplit(url)
    netloc = f"{user}:{password}@{parts.hostname}:{port or parts.port}"
    return urlunsplit(parts._replace(netloc=netloc, path=parts.path if path is None else path))


def shown(url: str) -> str:
    """``url`` as an error shows it: the password as ``***``."""
    parts = urlsplit(url)
    return url.replace(f":{parts.password}@", ":***@", 1)


@pytest.fixture
def redis_user(redis_url: str, unique: str) -> Iterator[str]:
    """An ACL user of the test's own on the shared Redis, password ``right``; deleted after."""
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", unique, "on", ">right", "~*", "&*", "+@all")
    yield unique
    admin.execute_command("ACL", "DELUSER", unique)
    admin.close()


@pytest.fixture(scope="module")
def nats_with_login(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``nats-server`` with JetStream whose one user is alice/right; its URL without a login."""
    binary = shutil.which("nats-server")
    assert binary is not None, "nats-server is not installed (apt-get install nats-server)"
    folder = tmp_path_factory.mktemp("nats")
    port = free_ports(1)[0]
    (folder / "nats.conf").write_text(
        f'port: {port}\nhost: 127.0.0.1\njetstream {{ store_dir: "{folder / "js"}" }}\n'
        "authorization { user: alice, password: right }\n")
    process = subprocess.Popen([binary, "-c", str(folder / "nats.conf")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, 30)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def broker_with_login(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The project's broker server whose one user is app/right; its URL without a login."""
    folder = tmp_path_factory.mktemp("broker")
    (folder / "reliable.toml").write_text(
        f'[broker.users.app]\npassword_hash = "{hash_password("right")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n')
    server = ServerProcess(folder / "data", "--settings", str(folder / "reliable.toml")).start()
    yield server.url
    server.stop()


Case = Callable[[pytest.FixtureRequest], tuple[str, str, str]]
"""A refusal: the settings file's table and URL for it, and words of the server's that the error must carry."""

CASES: dict[str, Case] = {
    "amqp wrong password": lambda r: (
        "transport", with_login(r.getfixturevalue("amqp_url"), "guest", "wrong"), "ACCESS_REFUSED"),
    "amqp no such vhost": lambda r: (
        "transport", with_login(r.getfixturevalue("amqp_url"), "guest", "guest", "/nosuchvhost"), "NOT_ALLOWED"),
    "redis transport wrong password": lambda r: (
        "transport", with_login(r.getfixturevalue("redis_url"), r.getfixturevalue("redis_user"), "wrong"),
        "invalid username-password pair"),
    "redis cache wrong password": lambda r: (
        "cache", with_login(r.getfixturevalue("redis_url"), r.getfixturevalue("redis_user"), "wrong"),
        "invalid username-password pair"),
    "nats wrong password": lambda r: (
        "transport", with_login(r.getfixturevalue("nats_with_login"), "alice", "wrong"), "Authorization Violation"),
    "broker wrong password": lambda r: (
        "transport", with_login(r.getfixturevalue("broker_with_login"), "app", "wrong"), "wrong user name or password"),
}


def project(folder: Path, table: str, url: str) -> Path:
    (folder / "orders_app.py").write_text(APP_MODULE)
    store = f'[store]\nurl = "sqlite:///{folder / "store.db"}"\n'
    transport = "" if table == "transport" else f'[transport]\nurl = "embedded://{folder / "broker"}"\n'
    (folder / "reliable.toml").write_text(f'{store}{transport}[{table}]\nurl = "{url}"\n')
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_run_stops_with_the_setting_and_the_servers_words(tmp_path: Path, request: pytest.FixtureRequest,
                                                          case: str) -> None:
    table, url, words = CASES[case](request)
    if table == "cache":  # the cache is asked only about a message's token
        App(Settings.load(project(tmp_path, table, url) / "reliable.toml")).publish("orders", {"order": "o-1"})

    done = reliable_cmd(project(tmp_path, table, url), "run", "orders_app:app", "--until-idle")

    assert done.returncode == 2, done.stderr
    lines = said(done)
    assert len(lines) == 1 and lines[0].startswith(f"error: [{table}] url = '{shown(url)}': the server refused it: "), lines
    assert words in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("case", ["amqp wrong password", "broker wrong password"])
def test_relay_stops_and_leaves_the_outbox_rows_pending(tmp_path: Path, request: pytest.FixtureRequest,
                                                        case: str) -> None:
    table, url, words = CASES[case](request)
    store = open_store(f"sqlite:///{project(tmp_path, table, url) / 'store.db'}")
    with store.transaction() as tx:
        tx.publish("orders", {"order": "o-1"})

    done = reliable_cmd(tmp_path, "relay")

    assert done.returncode == 2, done.stderr
    assert words in said(done)[-1]
    status = store.outbox.status()
    assert (status.backlog, status.failed, status.sent) == (1, 0, 0)  # not marked failed: sent once the login is right
    store.close()


@pytest.fixture
def shipping(amqp_url: str, unique: str) -> Iterator[str]:
    """The query of a URL whose queues are the test's own (namespace ``unique``): those of the group
    ``shipping`` on the topic ``unique`` are deleted afterwards."""
    yield f"?namespace={unique}"
    with AmqpTransport(amqp_url, namespace=unique) as transport:
        transport.declare("shipping", [unique])  # so that purge knows the group's queues
        transport.purge()


def test_a_transport_down_from_the_start_is_waited_out(tmp_path: Path, amqp_url: str, unique: str,
                                                      shipping: str) -> None:
    parts = urlsplit(amqp_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    url = with_login(amqp_url, parts.username or "guest", parts.password or "guest", port=proxy.port) + shipping
    seen: list[str] = []
    env = {"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}", "RELIABLE_TRANSPORT__URL": url}
    app = App(Settings.load(None, env=env))

    @app.handler(unique, group="shipping")
    def ship(msg: Message, tx: object) -> None:
        seen.append(msg.body["order"])

    app.publish(unique, {"order": "o-1"})
    proxy.cut()
    run_through_outage(app, lambda: app.run_state.alive()["running"] and not app.run_state.transports_reachable(),
                       "the worker waiting out the outage", proxy.restore)
    assert seen == ["o-1"]
    app.close()
    proxy.close()


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def amqp_user(amqp_url: str, unique: str) -> Iterator[str]:
    """A RabbitMQ user of the test's own (password ``right``) on the URL's vhost; deleted after."""
    vhost = unquote(urlsplit(amqp_url).path.lstrip("/")) or "/"
    rabbitmqctl("add_user", unique, "right")
    rabbitmqctl("set_permissions", "-p", vhost, unique, ".*", ".*", ".*")
    yield unique
    rabbitmqctl("delete_user", unique)


def test_a_login_refused_after_it_worked_is_waited_out_as_an_error(tmp_path: Path, amqp_url: str, unique: str,
                                                                   shipping: str, amqp_user: str) -> None:
    seen: list[str] = []
    env = {"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
           "RELIABLE_TRANSPORT__URL": with_login(amqp_url, amqp_user, "right") + shipping}
    app = App(Settings.load(None, env=env))

    @app.handler(unique, group="shipping")
    def ship(msg: Message, tx: object) -> None:
        seen.append(msg.body["order"])

    with capture_logs() as logs:
        run = Running(app)
        app.publish(unique, {"order": "o-1"})
        wait_until(lambda: seen == ["o-1"], "the first order handled")

        rabbitmqctl("change_password", amqp_user, "rotated")  # and its connections closed: the next is refused
        rabbitmqctl("close_all_user_connections", amqp_user, "password rotated")
        refusal = wait_until(lambda: next((e for e in logs if e["event"] == "backend_refused"), None),
                             "the refusal logged")
        assert refusal["log_level"] == "error"
        assert refusal["setting"].startswith("[transport] url") and "ACCESS_REFUSED" in refusal["error"]
        assert run.thread.is_alive()

        rabbitmqctl("change_password", amqp_user, "right")
        app.publish(unique, {"order": "o-2"})  # retried while the publisher's connection is refused
        wait_until(lambda: seen == ["o-1", "o-2"], "the second order handled once the password is right again")
        app.stop()
        run.join()
    assert run.error is None, run.error
    assert app.dead_letters("shipping") == []
    app.close()


@pytest.mark.parametrize("case", [c for c in CASES if "transport" in c or c.startswith(("amqp", "nats", "broker"))])
def test_publish_raises_the_refusal_at_once(tmp_path: Path, request: pytest.FixtureRequest, case: str) -> None:
    """Not retried for ``publish_timeout`` as an outage would be (the old code: 30 s, then an outage error)."""
    table, url, words = CASES[case](request)
    app = App(Settings.load(project(tmp_path, table, url) / "reliable.toml"))
    with pytest.raises(BackendRefusedError) as refused:
        app.publish("orders", {"order": "o-1"})
    assert refused.value.setting == f"[transport] url = '{shown(url)}'" and words in str(refused.value)
    app.close()


class NatsServer:
    """A ``nats-server`` with JetStream on ``port``, stopped and started again over the same store."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("nats-server")
        assert binary is not None, "nats-server is not installed (apt-get install nats-server)"
        self.port = free_ports(1)[0]
        self.command = [binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(folder)]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port, 30)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)


def test_a_nats_server_down_when_the_worker_starts_is_waited_out(tmp_path: Path, unique: str) -> None:
    """``nats://`` connects as the app opens its backends: that outage is waited out too."""
    server = NatsServer(tmp_path / "js")
    seen: list[str] = []

    def make() -> App:
        env = {"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}", "RELIABLE_TRANSPORT__URL": server.url}
        app = App(Settings.load(None, env=env))

        @app.handler(unique, group="shipping")
        def ship(msg: Message, tx: object) -> None:
            seen.append(msg.body["order"])

        return app

    server.start()
    try:
        before = make()
        before.publish(unique, {"order": "o-1"})
        before.close()
        server.stop()
        app = make()
        with capture_logs() as logs:
            run_through_outage(app, lambda: sum(e["event"] == "backends_unavailable" for e in logs) >= 2,
                               "two tries to connect", server.start)
        assert seen == ["o-1"]
        app.close()
    finally:
        server.stop()
