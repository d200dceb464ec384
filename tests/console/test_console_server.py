"""`[broker] console_port`: the broker server serves the console, with its own users and rights."""

from __future__ import annotations

import re
from pathlib import Path

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.server.auth import hash_password
from tests.broker.server.serving import ServerProcess
from tests.console.http import Visitor
from tests.waiting import wait_until

CONSOLE = re.compile(r"console\.serving\W+url=(http://127\.0\.0\.1:\d+)")


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
    finally:
        assert server.stop() == 0


def _console_url(log: Path) -> str:
    return str(wait_until(lambda: CONSOLE.findall(log.read_text()), "the console's address in the log")[-1])
