"""``max_deliveries`` in ``[broker]``: a message nacked forever reaches ``%DLQ%<group>`` on a server,
and so does one whose deliveries end without an ack in any other way (its consumer killed, its
lease expired).

The setting existed in the engine's `DeliveryConfig` but the server never
passed it on: a message rolled back forever through the server was delivered
forever. Here a server with ``max_deliveries = 3`` is driven by the native
client: the third nack moves the message to the group's dead-letter queue.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ROOT, ServerProcess
from tests.waiting import wait_until

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


CRASHER = """
import os, signal, sys
from broker.client import Client
client = Client(sys.argv[1])
member = client.join("crashing", [sys.argv[2]])
deliveries = client.fetch(member, 10, 20.0)
print(" ".join(str(d.delivery_count) for d in deliveries), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the message kills its consumer: no ack, no goodbye
"""


def test_a_message_that_kills_its_consumer_reaches_the_dead_letter_queue(server, unique) -> None:
    """Each consumer process is killed with the message unacknowledged: the server sees its
    connection end, and that ending counts as a delivery, as a nack would."""
    client = Client(server.url)
    client.publish(unique, [OutgoingMessage(b"deadly", message_id=f"{unique}-1")])
    counts: list[str] = []
    for _ in range(MAX_DELIVERIES):
        crashed = subprocess.run([sys.executable, "-c", CRASHER, server.url, unique], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                                 text=True, timeout=60)
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        counts.append(crashed.stdout.strip())  # the next one waits for the server to release it
    assert counts == [str(n) for n in range(1, MAX_DELIVERIES + 1)]
    wait_until(lambda: client.dlq_waiting("crashing") == 1, "the message in %DLQ%crashing")
    [dead] = client.dlq_list("crashing")
    assert dead.body == b"deadly" and "member left" in dead.headers["x-dlq-cause"]
    member = client.join("crashing", [unique])
    assert client.fetch(member, 10, 0.2) == []
    client.close()


def test_a_message_whose_lease_expires_every_time_reaches_the_dead_letter_queue(server, unique) -> None:
    """A consumer that hangs on the message (its lease runs out, it never acks): each expiry
    counts as a delivery."""
    client = Client(server.url)
    client.publish(unique, [OutgoingMessage(b"hangs", message_id=f"{unique}-1")])
    member = client.join("hanging", [unique], lease=0.2)
    counts: list[int] = []
    deadline = time.monotonic() + WAIT
    while client.dlq_waiting("hanging") == 0 and time.monotonic() < deadline:
        counts.extend(d.delivery_count for d in client.fetch(member, 10, 0.5))  # never acked
    assert counts == list(range(1, MAX_DELIVERIES + 1))
    [dead] = client.dlq_list("hanging")
    assert dead.body == b"hangs" and "lease expired" in dead.headers["x-dlq-cause"]
    client.close()
