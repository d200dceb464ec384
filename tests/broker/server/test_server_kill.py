"""50 ``kill -9``s of the broker server during ``sync`` produce, producers retrying.

Jepsen's total-queue categories at the end: *lost* (acknowledged to a
producer, never consumed), *unexpected* (consumed, never sent),
*duplicated* (consumed more than once) and *recovered* (sent, not
acknowledged because the server died, consumed anyway). Every resend keeps
its message ids (or, for messages without ids, its batch id), so the
broker drops a copy whose first send reached the store: zero lost, zero
unexpected, zero duplicated. A batch id is checked after a restart by
reading the batch's run in the log, so a batch a kill cut short in its write
gets only its lost tail appended on the resend. A consumer whose
connection dies mid-batch loses its unacknowledged messages to another member.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerError
from tests.broker.server.serving import ServerProcess

KILLS = 50


@pytest.mark.parametrize("named", [True, False], ids=["message ids", "batch ids"])
@pytest.mark.parametrize("kills", [KILLS, pytest.param(300, marks=pytest.mark.soak)])
def test_fifty_kills_during_sync_produce_lose_nothing_and_invent_nothing(tmp_path, unique, kills,
                                                                         named):
    server = ServerProcess(tmp_path / "data").start()
    port = server.port
    sent: set[str] = set()
    acknowledged: set[str] = set()
    dropped: list[int] = []  # per resent publish, how many of its messages the broker had already
    stop = threading.Event()

    def produce(name: str) -> None:
        client = Client(f"127.0.0.1:{port}", publish_retry_seconds=60)
        number = 0
        while not stop.is_set():
            bodies = [f"{name}-{number + i}" for i in range(5)]  # what the audit counts
            batch = [OutgoingMessage(body.encode(), message_id=body if named else "") for body in bodies]
            sent.update(bodies)
            try:
                placed = client.publish(unique, batch)  # retried over reconnects, same ids or batch id
            except BrokerError:
                continue  # gave up on this batch: sent, never acknowledged
            assert named or len({p.message_id.rpartition(".")[0] for p in placed}) == 1
            if any(p.duplicate for p in placed):
                dropped.append(sum(p.duplicate for p in placed))
            acknowledged.update(bodies)
            number += 5
        client.close()

    producers = [threading.Thread(target=produce, args=(f"p{n}",)) for n in range(2)]
    for producer in producers:
        producer.start()
    rng = random.Random(50)
    for kill in range(kills):
        since = len(acknowledged)
        deadline = time.monotonic() + 60
        while len(acknowledged) < since + 10:  # the producers are through the restart: kill mid-produce
            assert time.monotonic() < deadline, f"no publish acknowledged in 60 s after restart {kill}"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        server.kill()
        server = ServerProcess(tmp_path / "data", port=port).start()
    stop.set()
    for producer in producers:
        producer.join(timeout=120)

    consumed: Counter[str] = Counter()
    consumer = Client(f"127.0.0.1:{port}")
    member = consumer.join("audit", [unique])
    while deliveries := consumer.fetch(member, 500, 1.0):
        consumer.ack(member, [d.receipt for d in deliveries])
        consumed.update(d.body.decode() for d in deliveries)
    lost = acknowledged - set(consumed)
    unexpected = set(consumed) - sent
    duplicated = {m for m, n in consumed.items() if n > 1}
    recovered = (set(consumed) & sent) - acknowledged
    print(f"sent {len(sent)}, acknowledged {len(acknowledged)}, lost {len(lost)}, unexpected "
          f"{len(unexpected)}, duplicated {len(duplicated)}, recovered {len(recovered)}; "
          f"resends the broker dropped as duplicates {len(dropped)} ({sum(dropped)} messages)")
    assert len(acknowledged) >= 10 * kills  # every kill fell between acknowledged publishes
    assert not lost and not unexpected and not duplicated
    assert dropped  # some kills fell after a publish was written, before its reply
    consumer.close()
    assert server.stop() == 0  # SIGTERM: a graceful stop


def test_a_consumer_cut_mid_batch_loses_its_unacked_messages_to_another_member(tmp_path, unique):
    server = ServerProcess(tmp_path / "data").start()
    producer = Client(server.url)
    producer.publish(unique, [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(20)])
    doomed, survivor = Client(server.url), Client(server.url)
    held = doomed.fetch(doomed.join("g", [unique]), 8, 1.0)
    member = survivor.join("g", [unique])
    doomed.close()  # the connection dies with 8 messages unacknowledged
    received = []
    deadline = time.monotonic() + 30
    while len(received) < 20 and time.monotonic() < deadline:
        deliveries = survivor.fetch(member, 20, 0.5)
        survivor.ack(member, [d.receipt for d in deliveries])
        received += deliveries
    assert sorted(d.message_id for d in received) == sorted(f"m{n}" for n in range(20))
    again = [d for d in received if d.message_id in {h.message_id for h in held}]
    assert len(held) == 8 and all(d.delivery_count == 2 for d in again)
    for client in (producer, survivor):
        client.close()
    server.stop()
