"""The server's `Engine`: the synchronous engine off the event loop, long waits on threads of their own."""

from __future__ import annotations

import asyncio

from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.server.engine import Engine


def test_fetches_waiting_on_every_thread_do_not_hold_up_a_publish(tmp_path) -> None:
    async def scenario() -> None:
        broker = Broker(tmp_path / "broker")
        engine = Engine(broker, threads=2, waiting_threads=4)
        members = [await engine.join(f"g{n}", ["quiet"]) for n in range(4)]
        fetches = [asyncio.create_task(engine.fetch(m, 10, 2.0)) for m in members]
        await asyncio.sleep(0)  # let every fetch reach its thread
        placed = await asyncio.wait_for(engine.publish("busy", [OutgoingMessage(b"x")]), 10)
        assert placed[0].topic == "busy"
        assert not any(f.done() for f in fetches)  # the publish did not wait for them
        assert all(batch == [] for batch in await asyncio.gather(*fetches))
        engine.close()
        broker.close()

    asyncio.run(scenario())


def test_a_fetch_that_finds_messages_and_its_ack_need_no_free_thread(tmp_path) -> None:
    async def scenario() -> None:
        broker = Broker(tmp_path / "broker")
        engine = Engine(broker, threads=1, waiting_threads=1)
        waiting = await engine.join("idle", ["quiet"])
        long_poll = asyncio.create_task(engine.fetch(waiting, 10, 2.0))  # holds the one waiting thread
        await asyncio.sleep(0)
        broker.publish("busy", [OutgoingMessage(b"x"), OutgoingMessage(b"y")])
        member = await engine.join("g", ["busy"])
        taken = await asyncio.wait_for(engine.fetch_columns(member, 10, 2.0), 10)
        assert sorted(d.body for d in taken.deliveries()) == [b"x", b"y"]
        await asyncio.wait_for(engine.ack(member, list(taken.columns["receipt"])), 10)
        assert broker.pending("g", ["busy"]) == 0
        assert not long_poll.done()
        assert await long_poll == []
        engine.close()
        broker.close()

    asyncio.run(scenario())
