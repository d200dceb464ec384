"""The asyncio client: pipelined calls, publishes resent over a killed server keep their ids, a consumer rejoins."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from broker.async_client import AsyncClient, AsyncConsumer
from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProcess]:
    started = ServerProcess(tmp_path / "data").start()
    yield started
    if started.running:
        started.stop()


def test_many_coroutines_pipeline_on_one_connection(server, unique) -> None:
    async def scenario() -> list[bytes]:
        async with AsyncClient(server.url) as client:
            await asyncio.gather(*(client.publish(unique, [OutgoingMessage(f"m{n}".encode())])
                                   for n in range(200)))
            consumer = AsyncConsumer(client, "g", [unique])
            got: list[bytes] = []
            while len(got) < 200:
                batch = await consumer.fetch(100, 2.0)
                assert batch
                await consumer.ack(batch)
                got += [d.body for d in batch]
            assert [q.lag for q in await client.lag("g")] == [0] * len(await client.lag("g"))
            await consumer.close()
            return got

    assert sorted(asyncio.run(scenario())) == sorted(f"m{n}".encode() for n in range(200))


def test_a_killed_server_publishes_resent_with_their_ids_and_the_consumer_rejoins(server, unique) -> None:
    killed, restarted = threading.Event(), threading.Event()

    def kill_and_restart() -> None:
        server.kill()
        killed.set()
        server.start()  # same port, same directory: recovery at start
        restarted.set()

    async def consume(consumer: AsyncConsumer, got: list[str], until: int) -> None:
        while len(set(got)) < until:
            batch = await consumer.fetch(50, 2.0)
            await consumer.ack(batch)
            got += [d.message_id for d in batch]

    async def scenario() -> tuple[list[str], list[str]]:
        async with AsyncClient(server.url, publish_retry_seconds=60) as client:
            consumer = AsyncConsumer(client, "g", [unique])
            sent: list[str] = []
            got: list[str] = []
            for n in range(40):
                if n == 20:
                    await consume(consumer, got, 20)
                    threading.Thread(target=kill_and_restart).start()
                    assert await asyncio.to_thread(killed.wait, 30)  # the rest goes to a dead server
                placed = await client.publish(unique, [OutgoingMessage(b"x", message_id=f"id-{n}")])
                sent += [p.message_id for p in placed]
            assert restarted.is_set()  # publishes 20.. were resent until the server was back
            await consume(consumer, got, 40)  # the same consumer object, joined again
            await consumer.close()
            return sent, got

    sent, got = asyncio.run(scenario())
    assert sent == [f"id-{n}" for n in range(40)]
    assert sorted(set(got)) == sorted(sent)
    stored = Client(server.url)
    assert sum(t.messages for t in stored.topics() if t.name == unique) == 40  # no resend stored twice
    stored.close()
