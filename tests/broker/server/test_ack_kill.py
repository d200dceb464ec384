"""20 ``kill -9``s of the broker server (``flush = "sync"``) while consumers acknowledge.

An ack the server confirmed must survive the kill: no message whose ack was
confirmed before a kill is ever fetched again. Before the ack journal, group
offsets reached disk about once a second, so 20-38% of the confirmed acks of
the last second were delivered again after each kill.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerError
from tests.broker.server.serving import ServerProcess

KILLS = 20
GROUP = "ackers"


@pytest.mark.parametrize("kills", [KILLS, pytest.param(100, marks=pytest.mark.soak)])
def test_no_ack_confirmed_before_a_kill_is_delivered_again(tmp_path, unique, kills):
    server = ServerProcess(tmp_path / "data").start()
    port = server.port
    publisher = Client(f"127.0.0.1:{port}")
    total = 2500 * kills  # more than the consumers get through
    for start in range(0, total, 1000):
        publisher.publish(unique, [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}")
                                   for n in range(start, min(total, start + 1000))])
    publisher.close()
    confirmed: set[str] = set()  # ids whose ack the server confirmed
    again: list[str] = []  # ids fetched although their ack had been confirmed
    lock = threading.Lock()
    stop = threading.Event()
    drained = threading.Event()  # a fetch found nothing: every message is acked (confirmed or not)

    def consume() -> None:
        while not stop.is_set():
            client: Client | None = None
            try:
                client = Client(f"127.0.0.1:{port}")
                member = client.join(GROUP, [unique], prefetch=20, lease=600.0)
                while not stop.is_set():
                    deliveries = client.fetch(member, 20, 0.5)
                    if not deliveries:
                        drained.set()
                    with lock:
                        again.extend(d.message_id for d in deliveries if d.message_id in confirmed)
                    if deliveries:
                        client.ack(member, [d.receipt for d in deliveries])
                        with lock:
                            confirmed.update(d.message_id for d in deliveries)
            except (BrokerError, OSError):
                pass  # the server died: a new connection, a new member
            finally:
                if client is not None:
                    client.close()

    consumers = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    rng = random.Random(20)
    try:
        for kill in range(kills):
            since = len(confirmed)
            deadline = time.monotonic() + 60
            drained.clear()
            while len(confirmed) < since + 40 and not drained.is_set():  # through the restart: kill mid-ack
                assert time.monotonic() < deadline, \
                    f"no ack confirmed in 60 s after restart {kill} ({len(confirmed)} of {total} so far)"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            server.kill()
            server = ServerProcess(tmp_path / "data", port=port).start()
        since = len(confirmed)
        deadline = time.monotonic() + 60
        drained.clear()
        while len(confirmed) < since + 40 and not drained.is_set():  # fetched after the last restart
            assert time.monotonic() < deadline, "no ack confirmed in 60 s after the last restart"
            time.sleep(0.01)
    finally:
        stop.set()
        for consumer in consumers:
            consumer.join(timeout=120)
    print(f"acks confirmed {len(confirmed)} of {total}; fetched again after a confirmed ack {len(again)}")
    assert len(confirmed) >= 40 * kills  # kills fell between confirmed acks
    assert not again, f"{len(again)} messages delivered again after their ack was confirmed: {again[:10]}"
    assert server.stop() == 0
