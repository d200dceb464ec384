"""``max_deliveries`` in ``[broker]``: a message nacked forever reaches ``%DLQ%<group>`` on a server.

The setting existed in the engine's `DeliveryConfig` but the server never
passed it on: a message rolled back forever through the server was delivered
forever. Here a server with ``max_deliveries = 3`` is driven by the native
client: the third nack moves the message to the group's dead-letter queue.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess

MAX_DELIVERIES = 3
WAIT = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("max-deliveries")
    settings = folder / "reliable.toml"
    settings.write_text(f"[broker]\nmax_deliveries = {MAX_DELIVERIES}\n")
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def test_a_message_nacked_forever_reaches_the_dead_letter_queue(server, unique) -> None:
    client = Client(server.url)
    client.publish(unique, [OutgoingMessage(b"poison", message_id=f"{unique}-1")])
    member = client.join("rollback", [unique])
    counts: list[int] = []
    deadline = time.monotonic() + WAIT
    while client.dlq_waiting("rollback") == 0 and time.monotonic() < deadline:
        for delivery in client.fetch(member, 10, 0.5):
            counts.append(delivery.delivery_count)
            client.nack(member, [delivery.receipt], 0.0)
    assert counts == list(range(1, MAX_DELIVERIES + 1))
    [dead] = client.dlq_list("rollback")
    assert dead.body == b"poison"
    assert client.fetch(member, 10, 0.5) == []
    client.close()
