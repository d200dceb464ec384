"""One user cannot use up ``max_topics`` for everyone: ``max_topics_per_user`` new topics each.

Past ``max_topics`` the broker refuses every new topic, whoever asks. The user ``orders``,
allowed only ``orders.*``, published to a new name each time (natively, or by STOMP SEND) until
the broker held ``max_topics``; then ``billing`` could not make its first topic. A real server,
real clients.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
import stomp

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import TooManyTopicsError
from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_group_quota import _user
from tests.broker.server.test_stomp import Inbox
from tests.waiting import wait_until

MAX_TOPICS, PER_USER = 6, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("topics")
    settings = folder / "reliable.toml"
    settings.write_text(f"[broker]\nmax_topics = {MAX_TOPICS}\nmax_topics_per_user = {PER_USER}\nmetrics_port = 0\n"
                        + _user("billing", "payments.*", "billing-*") + _user("orders", "orders.*", "orders-*"))
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def login(server: ServerProcess, name: str) -> Client:
    return Client(server.url, user=name, password=name)


def test_a_user_publishing_to_new_names_in_a_loop_leaves_room_for_other_teams(server, unique) -> None:
    orders = login(server, "orders")
    made, refusal = [], ""
    for n in range(MAX_TOPICS):  # enough to fill max_topics, had nothing stopped it
        try:
            orders.publish(f"orders.{unique}.{n}", [OutgoingMessage(b"x")])
            made.append(n)
        except TooManyTopicsError as error:
            refusal = str(error)
            break
    assert made == list(range(PER_USER))  # six, and the broker full, before
    assert "max_topics_per_user=3" in refusal
    connection, inbox = stomp.Connection12([("127.0.0.1", server.stomp_port)]), Inbox()
    connection.set_listener("inbox", inbox)
    connection.connect("orders", "orders", wait=True)
    connection.send(f"/queue/orders.{unique}.stomp", "z")  # STOMP counts alike
    wait_until(lambda: inbox.errors, "the SEND to be refused")
    assert "max_topics_per_user=3" in inbox.errors[0].headers["message"]
    orders.publish(f"orders.{unique}.0", [OutgoingMessage(b"y")])  # its topics still take messages
    billing = login(server, "billing")  # another team makes its first topic
    billing.publish(f"payments.{unique}", [OutgoingMessage(b"z")])
    orders.close()
    billing.close()
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'broker_user_topics{user="orders"} 3.0' in scraped
    assert 'broker_user_topics{user="billing"} 1.0' in scraped
