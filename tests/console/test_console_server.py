"""`[broker] console_port`: the broker server serves the console, with its own users and rights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ROOT, ServerProcess
from tests.console.http import Visitor
from tests.passwords import hash_password
from tests.waiting import wait_until

CONSOLE = re.compile(r"console\.serving\W+url=(http://127\.0\.0\.1:\d+)")
CONSOLE_JSON = re.compile(r'"url": "(http://127\.0\.0\.1:\d+)", "event": "console\.serving"')  # not a terminal


def test_the_broker_server_serves_the_console_to_its_own_users(tmp_path: Path) -> None:
    settings = tmp_path / "broker.toml"
    settings.write_text(
        "[broker]\nconsole_port = 0\n"
        f'[broker.users.ops]\npassword_hash = "{hash_password("ops-pw")}"\nadmin = true\n'
        f'[broker.users.orders]\npassword_hash = "{hash_password("orders-pw")}"\n'
        'produce = ["orders"]\nconsume = ["orders"]\n')
    server = ServerProcess(tmp_path / "data", "--settings", str(settings)).start()
    try:
        client = Client(server.url, user="ops", password="ops-pw")
        client.publish("orders", [OutgoingMessage(b"{}")])
        client.publish("payments", [OutgoingMessage(b"{}")])
        client.close()
        url = _console_url(server.log)
        ops, orders = Visitor(url), Visitor(url)
        assert ops.log_in("ops", "wrong") == 401
        assert ops.log_in("ops", "ops-pw") == 303
        assert orders.log_in("orders", "orders-pw") == 303
        topics = ops.get("/topics")[1]
        assert "orders" in topics and "payments" in topics
        topics = orders.get("/topics")[1]
        assert "orders" in topics and "payments" not in topics
        client = Client(server.url, user="ops", password="ops-pw")
        sizes = {t.name: t.bytes for t in client.topics()}  # the bytes kept, over the wire
        client.close()
        assert sizes["orders"] > 0 and f"{sizes['orders']} B" in ops.get("/topics")[1]
    finally:
        assert server.stop() == 0
    server.log.unlink()  # the restarted server's port is read from a fresh log
    server = ServerProcess(tmp_path / "data", "--settings", str(settings)).start()
    try:
        client = Client(server.url, user="ops", password="ops-pw")
        assert {t.name: t.bytes for t in client.topics()} == sizes  # recovered on restart
        client.close()
    finally:
        assert server.stop() == 0


def _console_url(log: Path) -> str:
    return str(wait_until(lambda: CONSOLE.findall(log.read_text()), "the console's address in the log")[-1])


def test_the_broker_servers_console_shows_the_handlers_counters_from_metrics(tmp_path: Path) -> None:
    """`reliable broker serve --metrics URL`: the Handlers page of the server's console reads a
    worker's /metrics (here this process's, where the handlers ran), as `reliable console` does."""
    from prometheus_client import start_http_server

    from tests.console.deployment import start

    deployment = start(tmp_path / "worker")
    deployment.blocked.add("p-9")
    deployment.app.publish("payments", {"payment": "p-9"})
    deployment.app.run(until_idle=True)
    deployment.console.stop()
    metrics, thread = start_http_server(0, addr="127.0.0.1")
    settings = tmp_path / "reliable.toml"
    settings.write_text(
        f'[store]\nurl = "sqlite:///{tmp_path / "store.db"}"\n'
        f'[broker]\ndata_dir = "{tmp_path / "data"}"\nstomp_port = false\nconsole_port = 0\n'
        f'[broker.users.ops]\npassword_hash = "{hash_password("ops-pw")}"\nadmin = true\n')
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "reliable.cli", "broker", "serve", "--settings", str(settings), "--port", "0",
             "--metrics", f"http://127.0.0.1:{metrics.server_port}/metrics"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        ops = Visitor(wait_until(lambda: CONSOLE_JSON.findall(log.read_text()), "the console's address")[-1])
        assert ops.log_in("ops", "ops-pw") == 303
        status, page = ops.get("/handlers")
        assert status == 200, page
        assert "<td>charge</td>" in page and "dead_lettered" in page
        assert 'href="/handlers"' in ops.get("/topics")[1]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        metrics.shutdown()
        thread.join()
        deployment.app.close()


def test_metrics_without_a_console_is_refused(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from reliable.cli import cli

    settings = tmp_path / "reliable.toml"
    settings.write_text("[broker]\nport = 0\n")
    result = CliRunner().invoke(cli, ["broker", "serve", "--settings", str(settings), "--port", "0",
                                      "--metrics", "http://127.0.0.1:9/metrics"])
    assert result.exit_code == 2 and "console_port" in result.output


def test_the_console_says_so_when_its_broker_server_is_down(tmp_path: Path) -> None:
    """`reliable console` over a `reliable://` server that stops: each page answers 503 naming the
    unreachable broker, rather than a bare 500; the pages come back with the server."""
    from broker.console.config import ConsoleConfig
    from broker.server.auth import Authenticator
    from reliable.console import serve
    from reliable.testing import test_app

    server = ServerProcess(tmp_path / "data").start()
    app = test_app(tmp_path / "app", transport=server.url)
    app.publish("payments", {"payment": "p-1"})
    console = serve(app, ConsoleConfig(port=0), Authenticator())
    try:
        operator = Visitor(console.url)
        assert operator.get("/topics")[0] == 200
        assert server.stop() == 0
        for path in ("/topics", "/groups", "/groups/billing", "/groups/billing/letters?source=broker"):
            status, page = operator.get(path)
            assert status == 503, (path, page)
            assert "the broker cannot be reached" in page and f"127.0.0.1:{server.port}" in page, path
        server.log.unlink()  # the restarted server's port is read from a fresh log
        server = ServerProcess(tmp_path / "data", port=server.port).start()
        assert "payments" in operator.get("/topics")[1]
    finally:
        console.stop()
        app.close()
        server.stop()


def _scraped(port: int, name: str, labels: dict[str, str]) -> float | None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return next((sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == name and sample.labels == labels), None)


def test_the_broker_servers_console_counts_its_refusals_and_names_its_own_settings(tmp_path: Path) -> None:
    """The console's refused connections were counted in a registry nobody served, and logged as
    "its max_connections_per_address=16": the broker's setting, not console_max_connections_per_address."""
    from tests.console.test_console_connections import closing
    from tests.framework.test_probe_limits import open_ones, silent

    settings = tmp_path / "broker.toml"
    settings.write_text("[broker]\nconsole_port = 0\nmetrics_port = 0\nconsole_max_connections_per_address = 2\n"
                        "console_request_timeout = 600\n")
    server = ServerProcess(tmp_path / "data", "--settings", str(settings)).start()
    url = _console_url(server.log)
    hostile = silent(("127.0.0.1", int(url.rsplit(":", 1)[1])), "127.0.0.2", 5)
    try:
        wait_until(lambda: len(open_ones(hostile)) == 2, "all but the address's 2 closed unread")
        refused = {"listener": "console", "reason": "per_address"}
        assert wait_until(lambda: _scraped(server.metrics_port, "broker_connections_refused_total", refused) == 3,
                          "3 refusals on the server's /metrics")
        log = server.log.read_text()
        assert "127.0.0.2 already holds 2 connections, its console_max_connections_per_address=2" in log
        assert "if it is a proxy, list it in console_trusted_proxies" in log
    finally:
        closing(hostile)
        assert server.stop() == 0


def test_reliable_console_serves_its_refusals_on_its_metrics_port(tmp_path: Path) -> None:
    """`reliable console`, beside no broker server, had nowhere to show its refusals."""
    from tests.console.test_console_connections import closing
    from tests.framework.test_probe_limits import open_ones, silent

    (tmp_path / "reliable.toml").write_text("[broker]\nconsole_max_connections_per_address = 1\n"
                                            "console_request_timeout = 600\n")
    log = tmp_path / "console.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}, "PYTHONPATH": str(ROOT),
           "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        console = subprocess.Popen([sys.executable, "-m", "reliable.cli", "console", "--port", "0",
                                    "--metrics-port", "0"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = wait_until(lambda: re.findall(r"console on (http://127\.0\.0\.1:\d+)", log.read_text()), "the console")[0]
        port = int(wait_until(lambda: re.findall(r"serving /metrics on http://127\.0\.0\.1:(\d+)", log.read_text()),
                              "the metrics port")[0])
        hostile = silent(("127.0.0.1", int(url.rsplit(":", 1)[1])), "127.0.0.3", 3)
        try:
            wait_until(lambda: len(open_ones(hostile)) == 1, "all but the address's 1 closed unread")
            refused = {"listener": "console", "reason": "per_address"}
            assert wait_until(lambda: _scraped(port, "broker_connections_refused_total", refused) == 2,
                              "2 refusals on the console's /metrics")
        finally:
            closing(hostile)
    finally:
        console.send_signal(signal.SIGTERM)
        assert console.wait(timeout=30) == 0, log.read_text()[-3000:]
