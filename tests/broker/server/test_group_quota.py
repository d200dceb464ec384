"""One user cannot use up ``max_groups`` for everyone: ``max_groups_per_user`` new groups each.

A group is never deleted, and past ``max_groups`` the broker refuses every new group. The user
``orders``, allowed only groups ``orders-*`` and topics ``orders.*``, joined new group names
(natively, or as STOMP ``/topic/`` subscriptions, one group each) until the broker held
``max_groups``; then ``billing`` could not make its first group. A real server, real clients.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import pytest
import stomp

from broker.client import Client
from broker.errors import TooManyGroupsError
from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_stomp import Inbox
from tests.passwords import hash_password
from tests.waiting import wait_until

MAX_GROUPS, PER_USER = 6, 3


def _user(name: str, topics: str, groups: str) -> str:
    return (f'[broker.users.{name}]\npassword_hash = "{hash_password(name)}"\n'
            f'produce = ["{topics}"]\nconsume = ["{topics}"]\ngroups = ["{groups}"]\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("quota")
    settings = folder / "reliable.toml"
    settings.write_text(f"[broker]\nmax_groups = {MAX_GROUPS}\nmax_groups_per_user = {PER_USER}\nmetrics_port = 0\n"
                        + _user("billing", "payments.*", "billing-*") + _user("orders", "orders.*", "orders-*"))
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def login(server: ServerProcess, name: str) -> Client:
    return Client(server.url, user=name, password=name)


def stomp_subscribe(server: ServerProcess, topic: str) -> str:
    """A ``/topic/`` subscription by ``orders``: the server's answer (a RECEIPT, or its ERROR)."""
    connection, inbox = stomp.Connection12([("127.0.0.1", server.stomp_port)]), Inbox()
    connection.set_listener("inbox", inbox)
    connection.connect("orders", "orders", wait=True)
    connection.subscribe(f"/topic/{topic}", id="1", receipt="subscribed")
    wait_until(lambda: inbox.receipts or inbox.errors, "the subscription's answer")
    answer = inbox.errors[0].headers.get("message", "") if inbox.errors else "subscribed"
    if connection.is_connected():
        connection.disconnect()
    return answer


def test_a_user_making_groups_in_a_loop_leaves_room_for_other_teams(server, unique) -> None:
    orders = login(server, "orders")
    made, refusal = [], ""
    for n in range(MAX_GROUPS):  # enough to fill max_groups, had nothing stopped it
        try:
            orders.leave(orders.join(f"orders-{unique}-{n}", [f"orders.{unique}"]))
            made.append(n)
        except TooManyGroupsError as error:
            refusal = str(error)
            break
    assert made == list(range(PER_USER))  # six, and the broker full, before
    assert "max_groups_per_user=3" in refusal
    assert "max_groups_per_user=3" in stomp_subscribe(server, f"orders.{unique}-stomp")  # a group too
    orders.leave(orders.join(f"orders-{unique}-0", [f"orders.{unique}"]))  # its own groups still join
    billing = login(server, "billing")  # another team makes its first group
    billing.leave(billing.join(f"billing-{unique}", [f"payments.{unique}"]))
    orders.close()
    billing.close()
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'broker_user_groups{user="orders"} 3.0' in scraped  # what an operator watches
    assert 'broker_user_groups{user="billing"} 1.0' in scraped
    assert re.search(r"^broker_groups 4\.0$", scraped, re.MULTILINE)  # orders' 3 and billing's
