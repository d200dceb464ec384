"""Members joining and leaving under load, in real threads.

Producers publish keyed messages while consumers join, take a batch, ack it
whole or leave without acking, and join again. A watcher checks, under the
engine's lock, that no queue is ever held by two members. At the end every
message was acknowledged exactly once (a batch left unacknowledged is
delivered again, to whoever holds the queue next) and, per key, in the
order it was published.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict

from broker.delivery.values import OutgoingMessage
from tests.broker.delivery.conftest import Open

KEYS = [f"customer-{n}" for n in range(12)]
PER_KEY = 150


def test_members_joining_and_leaving_under_load(open_broker: Open) -> None:
    broker = open_broker(queues=6, prefetch=20, lease=60.0, session_timeout=60.0, store_flush="async")
    acked: dict[str, list[int]] = defaultdict(list)  # key -> sequence numbers in ack order
    record = threading.Lock()
    done = threading.Event()
    twice: list[str] = []

    def produce(keys: list[str]) -> None:
        for number in range(PER_KEY):
            broker.publish("orders", [OutgoingMessage(f"{k}:{number}".encode(), key=k, message_id=f"{k}:{number}")
                                      for k in keys])

    def consume(seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            member = broker.join("g", ["orders"])
            for _ in range(rng.randint(1, 6)):
                deliveries = broker.fetch(member, rng.randint(1, 20), 0.05)
                if not deliveries:
                    continue
                if rng.random() < 0.15:
                    break  # leave with this batch unacknowledged: it goes to the queue's next holder
                with record:
                    broker.ack(member, [d.receipt for d in deliveries])
                    for d in deliveries:
                        key, number = d.body.decode().split(":")
                        acked[key].append(int(number))
            broker.leave(member)

    def watch() -> None:
        while not done.is_set():
            with broker.consuming.lock:
                for group in broker.consuming.membership.group_table.values():
                    for key, cursor in group.cursors.items():
                        holders = cursor.holders()
                        if len(holders) > 1:
                            twice.append(f"{key}: {holders}")

    threads = [threading.Thread(target=produce, args=(KEYS[n::3],)) for n in range(3)]
    threads += [threading.Thread(target=consume, args=(n,)) for n in range(4)]
    threads.append(threading.Thread(target=watch))
    for thread in threads:
        thread.start()
    for thread in threads[:3]:
        thread.join()
    deadline = 600
    while sum(map(len, acked.values())) < len(KEYS) * PER_KEY and deadline:
        deadline -= 1
        threading.Event().wait(0.1)
    done.set()
    for thread in threads[3:]:
        thread.join()
    assert not twice, twice[:3]
    for key in KEYS:
        assert acked[key] == list(range(PER_KEY)), key  # every message once, in its key's order
