"""The server's `Engine`: the synchronous engine off the event loop, long waits on threads of their own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from broker.delivery.engine import Broker
from broker.delivery.values import MessageColumns, OutgoingMessage
from broker.server.engine import Engine
from broker.store import FlushPolicy, StoreConfig
from broker.store.segment import Segment
from tests.waiting import wait_until

LONG_POLL = 60.0
"""Longer than any test here takes on a loaded machine: a publish to ``quiet`` ends the polls."""


def test_fetches_waiting_on_every_thread_do_not_hold_up_a_publish(tmp_path) -> None:
    async def scenario() -> None:
        broker = Broker(tmp_path / "broker")
        engine = Engine(broker, threads=2, waiting_threads=4)
        members = [await engine.join(f"g{n}", ["quiet"]) for n in range(4)]
        fetches = [asyncio.create_task(engine.fetch(m, 10, LONG_POLL)) for m in members]
        await asyncio.sleep(0)  # let every fetch reach its thread
        placed = await asyncio.wait_for(engine.publish("busy", [OutgoingMessage(b"x")]), 10)
        assert placed[0].topic == "busy"
        assert not any(f.done() for f in fetches)  # the publish did not wait for them
        broker.publish("quiet", [OutgoingMessage(b"end")])  # ends the long polls
        batches = await asyncio.wait_for(asyncio.gather(*fetches), 10)
        assert [[d.body for d in batch] for batch in batches] == [[b"end"]] * 4
        engine.close()
        broker.close()

    asyncio.run(scenario())


@asynccontextmanager
async def _waiting_threads_held(path: Path) -> AsyncIterator[tuple[Broker, Engine, str]]:
    """An engine whose one waiting thread a long poll holds, and a member of a group whose topic
    holds two messages ``x`` and ``y``; the long poll still waiting at the end, then ended."""
    broker = Broker(path)
    engine = Engine(broker, threads=1, waiting_threads=1)
    waiting = await engine.join("idle", ["quiet"])
    long_poll = asyncio.create_task(engine.fetch(waiting, 10, LONG_POLL))  # holds the one waiting thread
    await asyncio.sleep(0)
    broker.publish("busy", [OutgoingMessage(b"x"), OutgoingMessage(b"y")])
    member = await engine.join("g", ["busy"])
    yield broker, engine, member
    assert not long_poll.done()
    broker.publish("quiet", [OutgoingMessage(b"end")])  # ends the long poll
    assert [d.body for d in await asyncio.wait_for(long_poll, 10)] == [b"end"]
    engine.close()
    broker.close()


def test_a_fetch_that_finds_messages_and_its_ack_need_no_free_thread(tmp_path) -> None:
    async def scenario() -> None:
        async with _waiting_threads_held(tmp_path / "broker") as (broker, engine, member):
            taken = await asyncio.wait_for(engine.fetch_columns(member, 10, 2.0), 10)
            assert sorted(d.body for d in taken.deliveries()) == [b"x", b"y"]
            await asyncio.wait_for(engine.ack(member, list(taken.columns["receipt"])), 10)
            assert broker.pending("g", ["busy"]) == 0

    asyncio.run(scenario())


def test_a_fetch_that_finds_the_engine_busy_takes_its_messages_without_a_waiting_thread(tmp_path) -> None:
    """A publish wakes every long poll, and each takes the engine's lock to look: a fetch whose
    try without waiting met the lock held went to the pool of long waits, and with every waiting
    thread held by long polls it waited there for one, its messages ready (CI: 60 s, a timeout)."""
    async def scenario() -> None:
        async with _waiting_threads_held(tmp_path / "broker") as (broker, engine, member):
            held, done = threading.Event(), threading.Event()

            def hold() -> None:  # as a woken long poll holds the lock while it looks
                with broker.consuming.lock:
                    held.set()
                    done.wait(10)

            holder = threading.Thread(target=hold)
            holder.start()
            held.wait(10)
            fetch = asyncio.create_task(engine.fetch_columns(member, 10, 2.0))
            await asyncio.sleep(0.05)  # its try without waiting met the lock held
            done.set()
            holder.join()
            taken = await asyncio.wait_for(fetch, 10)
            assert sorted(d.body for d in taken.deliveries()) == [b"x", b"y"]

    asyncio.run(scenario())


@contextmanager
def _sync_engine(path: Path, threads: int = 32) -> Iterator[tuple[Broker, Engine]]:
    """A broker under `sync` flush (the server's) and its `Engine`, closed after."""
    broker = Broker(path, store_config=StoreConfig(flush=FlushPolicy.SYNC))
    engine = Engine(broker, threads=threads)
    try:
        yield broker, engine
    finally:
        engine.close()
        broker.close()


def _named(*ids: str) -> MessageColumns:
    return MessageColumns.of([OutgoingMessage(f"body {i}".encode(), message_id=i) for i in ids])


def test_a_publish_under_sync_runs_on_the_loop_and_needs_no_free_thread(tmp_path) -> None:
    async def scenario() -> None:
        with _sync_engine(tmp_path / "broker", threads=1) as (_, engine):
            held = threading.Event()
            busy = asyncio.get_running_loop().run_in_executor(engine._pool, held.wait)  # the one thread
            placed = await asyncio.wait_for(engine.publish_columns("t", _named("a", "b")), 10)
            assert placed.column("message_id") == ["a", "b"] and not any(placed.column("duplicate"))
            again = await asyncio.wait_for(engine.publish_columns("t", _named("a")), 10)
            assert again.column("duplicate") == [True]  # the window learned the ids on the loop too
            assert not busy.done()
            held.set()
            await busy

    asyncio.run(scenario())


def test_a_publish_cancelled_while_its_append_waits_still_leaves_its_ids_in_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client goes away while its publish waits for the fsync (a slow disk: the fsync
    waits for the test), as a resend is about to come on another connection."""
    disk_done, fsyncing = threading.Event(), threading.Event()
    real_fsync = Segment.fsync

    def slow_fsync(segment: Segment) -> None:
        fsyncing.set()
        disk_done.wait(10)
        real_fsync(segment)

    async def scenario() -> None:
        with _sync_engine(tmp_path / "broker") as (broker, engine):
            monkeypatch.setattr(Segment, "fsync", slow_fsync)
            publish = asyncio.create_task(engine.publish_columns("t", _named("x", "y")))
            while not fsyncing.is_set():
                await asyncio.sleep(0.01)
            publish.cancel()
            disk_done.set()
            deadline = time.monotonic() + 10
            while broker.publishing._dedup.get("t", "y") is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            resent = await engine.publish_columns("t", _named("x", "y"))
            assert resent.column("duplicate") == [True, True]
            assert sum(end - start for start, end in broker.queue_offsets("t")) == 2  # stored once
        assert publish.cancelled()

    asyncio.run(scenario())


def test_a_publish_goes_to_a_thread_while_another_holds_the_publishing_lock(tmp_path) -> None:
    async def scenario() -> None:
        with _sync_engine(tmp_path / "broker") as (broker, engine):
            taken, release = threading.Event(), threading.Event()

            def hold() -> None:
                with broker.publishing._lock:
                    taken.set()
                    release.wait()

            holder = threading.Thread(target=hold)
            holder.start()
            taken.wait()
            publish = asyncio.create_task(engine.publish_columns("t", _named("p")))
            await asyncio.sleep(0.2)
            assert not publish.done()  # waiting for the lock on a thread, the loop free meanwhile
            release.set()
            placed = await asyncio.wait_for(publish, 10)
            assert placed.column("message_id") == ["p"]
            holder.join()

    asyncio.run(scenario())


def test_a_waiting_fetch_cancelled_after_it_took_a_message_gives_it_back_unmarked(tmp_path) -> None:
    """The connection of a long poll ends (its task is cancelled) just after the fetch's thread
    leased a message: the message was never sent, so it comes back with its delivery count
    unmoved (not marked redelivered)."""
    async def scenario() -> None:
        broker = Broker(tmp_path / "broker")
        engine = Engine(broker, threads=2, waiting_threads=2)
        member = await engine.join("g", ["quiet"])
        long_poll = asyncio.create_task(engine.fetch(member, 10, LONG_POLL))
        await asyncio.sleep(0)  # the fetch finds nothing and waits on its thread
        broker.publish("quiet", [OutgoingMessage(b"leased")])
        wait_until(lambda: broker.consuming.leases.held(member) == 1, "the waiting fetch to lease the message")
        long_poll.cancel()  # before the loop hands the fetch its result: the message was never sent
        with pytest.raises(asyncio.CancelledError):
            await long_poll
        [again] = await asyncio.wait_for(engine.fetch(member, 10, 1.0), 10)
        assert (again.body, again.delivery_count) == (b"leased", 1)
        engine.close()
        broker.close()

    asyncio.run(scenario())
