"""The sync `Consumer`: the server killed and restarted mid-consumption, the same object goes on, nothing is lost."""

from __future__ import annotations

from broker.client import Client
from broker.consumer import Consumer
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess


def test_a_consumer_rejoins_after_the_server_was_killed(tmp_path, unique) -> None:
    server = ServerProcess(tmp_path / "data").start()
    client = Client(server.url)
    client.publish(unique, [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(60)])
    consumer = Consumer(client, "g", [unique])
    acked: set[str] = set()
    while len(acked) < 20:
        batch = consumer.fetch(10, 2.0)
        consumer.ack(batch)
        acked |= {d.message_id for d in batch}
    held = consumer.fetch(10, 2.0)  # delivered, never acked: the kill takes them
    server.kill()
    server.start()  # same port and directory
    consumer.ack(held)  # the member is gone: skipped, they come back
    while len(acked) < 60:
        batch = consumer.fetch(20, 2.0)
        consumer.ack(batch)
        acked |= {d.message_id for d in batch}
    assert acked == {f"m{n}" for n in range(60)}
    assert {d.message_id for d in held} <= acked
    consumer.close()
    client.close()
    assert server.stop() == 0
