"""A session's inbox: requests in the order they came, runs taken whole, a reader held back when full."""

from __future__ import annotations

import asyncio

from broker.server.inbox import Inbox, Pending


def pending(request_id: int, op: str, size: int = 10) -> Pending:
    return Pending(request_id, {"id": request_id, "op": op}, size)


def test_a_run_stops_at_the_first_request_that_does_not_join() -> None:
    async def scenario() -> list[list[int]]:
        inbox = Inbox(limit=1000)
        for n, op in enumerate(["publish", "publish", "publish", "ack", "publish"]):
            inbox.put(pending(n, op))
        first = await inbox.take()
        assert first is not None
        run = [first, *inbox.take_run(lambda queued: queued.op == "publish")]
        rest = [await inbox.take(), await inbox.take()]
        inbox.finished(len(run) + 2)
        assert inbox.idle
        return [[p.request_id for p in run], [p.request_id for p in rest if p is not None]]

    assert asyncio.run(scenario()) == [[0, 1, 2], [3, 4]]


def test_a_full_inbox_holds_the_reader_until_a_request_is_taken_and_close_ends_the_runner() -> None:
    async def scenario() -> None:
        inbox = Inbox(limit=25)
        inbox.put(pending(1, "ping"))
        inbox.put(pending(2, "ping", size=20))  # one frame past the limit is let in
        reader = asyncio.create_task(inbox.room())
        await asyncio.sleep(0.01)
        assert not reader.done()
        await inbox.take()
        await asyncio.wait_for(reader, 1)  # 20 bytes left: room again
        inbox.close()
        assert (await inbox.take()) is not None  # what came before the close still runs
        assert (await inbox.take()) is None
        assert not inbox.idle  # taken, not yet finished

    asyncio.run(scenario())


def test_settled_returns_once_every_request_taken_has_finished() -> None:
    async def scenario() -> None:
        inbox = Inbox(limit=100)
        inbox.put(pending(1, "hello"))
        settled = asyncio.create_task(inbox.settled())
        await inbox.take()
        await asyncio.sleep(0.01)
        assert not settled.done()  # taken, still running
        inbox.finished()
        await asyncio.wait_for(settled, 1)

    asyncio.run(scenario())
