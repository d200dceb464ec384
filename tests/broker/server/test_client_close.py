"""`Client.close()` ends its TCP connection at once, and the server releases what it held.

ActiveMQ's paging scenario through the sync client: consumers that connect,
take a few messages, acknowledge some and disconnect, again and again. The
server allows fewer connections than there are rounds, so a closed client
whose connection lingered (until ``idle_timeout``) would exhaust them; and a
last consumer gets every unacknowledged message back without waiting for the
30 s session timeout of the members that left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess

ROUNDS = 30
MAX_CONNECTIONS = 8  # fewer than the rounds: a lingering connection per round would exhaust them
WAIT = 20.0  # well below the 30 s session timeout a lingering member would hold its messages for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("client-close")
    settings = folder / "reliable.toml"
    settings.write_text(f"[broker]\nmax_connections = {MAX_CONNECTIONS}\nidle_timeout = 300\n")
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def test_consumers_that_take_a_few_and_disconnect_release_them_at_once(server, unique) -> None:
    total = ROUNDS * 4
    producer = Client(server.url)
    producer.publish(unique, [OutgoingMessage(f"m{n}".encode(), message_id=f"{unique}-{n}")
                              for n in range(total)])
    producer.close()
    acked: set[bytes] = set()
    for _ in range(ROUNDS):
        consumer = Client(server.url, publish_retry_seconds=0.5)
        member = consumer.join("pager", [unique])
        taken = consumer.fetch(member, 3, WAIT)
        assert taken, "a consumer found nothing: earlier members still hold the messages"
        consumer.ack(member, [taken[0].receipt])  # one done, the others left unacknowledged
        acked.add(taken[0].body)
        consumer.close()
    last = Client(server.url)
    member = last.join("pager", [unique])
    received: set[bytes] = set()
    deadline = time.monotonic() + WAIT
    while len(received) < total - len(acked) and time.monotonic() < deadline:
        batch = last.fetch(member, 100, 1.0)
        last.ack(member, [d.receipt for d in batch])
        received.update(d.body for d in batch)
    last.close()
    assert received.isdisjoint(acked)
    assert len(received) == total - len(acked)
