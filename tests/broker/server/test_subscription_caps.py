"""One connection holds at most ``max_subscriptions`` members (STOMP: subscriptions).

Each member joins a group, and every join rebalances the group: measured on one connection,
joins into one group took 0.9 ms each at the first 500 members and 6.7 ms at 3,000, growing with
the group, and each STOMP subscription also runs a task fetching for it. A limit per connection
bounds what one client makes the server hold (ActiveMQ's maximumConsumersAllowedPerConnection).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp
from stomp.exception import StompException

from broker.client import Client
from broker.protocol.errors import LimitExceededError
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.waiting import wait_until

LIMIT = 3


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, max_subscriptions=LIMIT) as started:
        yield started


def test_a_native_subscribe_past_the_limit_is_refused_and_the_connection_serves_on(server, unique) -> None:
    client = Client(threaded.native(server))
    members = [client.join(unique, [unique]) for _ in range(LIMIT)]
    with pytest.raises(LimitExceededError, match=f"holds {LIMIT} members, max_subscriptions={LIMIT}"):
        client.join(unique, [unique])
    assert [g.members for g in client.groups() if g.name == unique] == [LIMIT]  # none was joined
    client.leave(members[0])
    members.append(client.join(unique, [unique]))  # room again, on the same connection
    assert [g.members for g in client.groups() if g.name == unique] == [LIMIT]
    client.close()


def test_a_stomp_subscribe_past_the_limit_gets_an_error_and_the_others_are_left(server, unique) -> None:
    connection = stomp.Connection12([("127.0.0.1", server.port("stomp"))])
    errors: list[str] = []
    connection.set_listener("errors", type("Errors", (stomp.ConnectionListener,), {
        "on_error": lambda self, frame: errors.append(frame.headers.get("message", ""))})())
    connection.connect(wait=True)
    for n in range(LIMIT + 1):
        try:
            connection.subscribe(f"/queue/{unique}", id=str(n))
        except (StompException, OSError):  # the server may close before the last frame is sent
            break
    message = wait_until(lambda: errors, "the ERROR frame")[0]
    assert message == f"limit_exceeded: this connection holds {LIMIT} subscriptions, max_subscriptions={LIMIT}"
    observer = Client(threaded.native(server))
    wait_until(lambda: not [g for g in observer.groups() if g.name == unique and g.members],
               "the closed connection's members to leave")
    observer.close()
