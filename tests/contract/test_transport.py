"""The `Transport` contract, once, over every transport (memory, embedded, Redis Streams).

Timing-dependent behaviour (delays, visibility timeout) runs on a `FakeClock`;
nothing here sleeps for real beyond a few milliseconds.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from backends.clock import SYSTEM_CLOCK, Clock, FakeClock
from backends.errors import ConfigurationError, TransportError, UnsupportedURLError
from backends.transport import open_transport
from backends.transport.base import Transport
from backends.types import Failure, Message, OutgoingMessage, QueueRef

TRANSPORTS = ["memory", "embedded"]
VISIBILITY = 30.0

MakeTransport = Callable[..., Transport]


@pytest.fixture(params=TRANSPORTS)
def make_transport(request, tmp_path: Path, unique: str) -> Iterator[MakeTransport]:
    """Opens transports of one kind sharing one place (directory / Redis namespace)."""
    opened: list[Transport] = []
    if request.param == "memory":
        url = "memory://"
    elif request.param == "embedded":
        url = f"embedded://{tmp_path / 'broker'}"
    else:
        url = f"{request.getfixturevalue('redis_url')}?namespace={unique}"

    def make(clock: Clock = SYSTEM_CLOCK, **options) -> Transport:
        options.setdefault("visibility_timeout", VISIBILITY)
        transport = open_transport(url, clock, **options)
        opened.append(transport)
        return transport

    yield make
    for transport in opened:
        if hasattr(transport, "purge"):
            transport.purge()
        transport.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def transport(make_transport: MakeTransport, clock: FakeClock) -> Transport:
    return make_transport(clock)


def outgoing(count: int, prefix: str = "m", **fields) -> list[OutgoingMessage]:
    return [
        OutgoingMessage(f'{{"n":{n}}}'.encode(), message_id=f"{prefix}{n}", **fields)
        for n in range(count)
    ]


def drain(transport: Transport, group: str, topic: str, batch: int = 10) -> list[Message]:
    """Fetch and ack until nothing is due."""
    received: list[Message] = []
    while messages := transport.fetch(group, topic, batch, 0):
        transport.ack(group, messages)
        received += messages
    return received


def failure(attempts: int = 3) -> Failure:
    return Failure("ValueError", "bad", "Traceback ...", attempts, 1.0, 2.0)


# publishing and placement


def test_keyed_messages_go_to_crc32_queue_with_contiguous_offsets(
    transport: Transport, unique: str
) -> None:
    keys = [f"order-{n % 7}" for n in range(40)]
    transport.publish(unique, [OutgoingMessage(b"{}", key=key) for key in keys])
    received = drain(transport, "g", unique)
    assert len(received) == 40
    for message in received:
        assert message.queue == zlib.crc32(message.key.encode()) % 4
    for queue in range(4):
        offsets = sorted(m.offset for m in received if m.queue == queue)
        assert offsets == list(range(len(offsets)))


def test_keyless_messages_spread_round_robin(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(8))
    received = drain(transport, "g", unique)
    assert sorted(m.queue for m in received) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_message_keeps_what_the_producer_gave(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(
        unique,
        [
            OutgoingMessage(b"\x00\xffraw", key="k", headers={"h": "v"}, message_id="id-1"),
            OutgoingMessage(b"{}"),
        ],
    )
    first, second = sorted(drain(transport, "g", unique), key=lambda m: m.id != "id-1")
    assert (first.id, first.topic, first.payload, first.key, dict(first.headers)) == (
        "id-1",
        unique,
        b"\x00\xffraw",
        "k",
        {"h": "v"},
    )
    assert (first.attempt, first.first_failure_at, first.published_at) == (1, None, clock.time())
    assert len(second.id) == 32 and int(second.id, 16) >= 0


def test_bad_arguments_are_named(transport: Transport, unique: str) -> None:
    with pytest.raises(TransportError, match="delay"):
        transport.publish(unique, [OutgoingMessage(b"{}", delay=-1)])
    with pytest.raises(TransportError, match="max_messages"):
        transport.fetch("g", unique, 0, 0)
    with pytest.raises(TransportError, match="topic"):
        transport.publish("", outgoing(1))


# fetching: once per group, one fetcher at a time


def test_each_group_gets_every_message_once(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(25))
    for group in ("billing", "audit"):
        assert sorted(m.id for m in drain(transport, group, unique, batch=7)) == sorted(
            f"m{n}" for n in range(25)
        )
        assert transport.fetch(group, unique, 10, 0) == []


def test_concurrent_fetchers_never_share_a_message(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(400))
    seen: list[list[str]] = [[] for _ in range(4)]

    def consume(index: int) -> None:
        while messages := transport.fetch("g", unique, 7, 0):
            seen[index] += [m.id for m in messages]
            transport.ack("g", messages)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [message_id for ids in seen for message_id in ids]
    assert len(everything) == len(set(everything)) == 400


def test_fetch_respects_max_messages_and_pending_counts(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(10))
    assert transport.pending("g", unique) == 10
    batch = transport.fetch("g", unique, 4, 0)
    assert len(batch) == 4
    assert transport.pending("g", unique) == 10  # in flight still counts
    transport.ack("g", batch)
    assert transport.pending("g", unique) == 6
    assert transport.pending("other", unique) == 10
    assert transport.pending("g", "never-published") == 0


# acks


def test_ack_is_idempotent_and_final(transport: Transport, clock: FakeClock, unique: str) -> None:
    transport.publish(unique, outgoing(3))
    batch = transport.fetch("g", unique, 3, 0)
    transport.ack("g", batch)
    transport.ack("g", batch)  # again: no-op
    transport.ack("g", [Message("nope", unique, 0, 999, b"{}")])  # unknown: no-op
    transport.nack("g", batch[0].next_attempt(clock.time()), 0)  # late nack: no resurrection
    clock.advance(VISIBILITY * 2)
    assert transport.fetch("g", unique, 10, 0) == []
    assert transport.pending("g", unique) == 0


def test_nack_redelivers_after_delay_with_what_the_caller_stored(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(1, headers={"a": "1"}))
    (message,) = transport.fetch("g", unique, 1, 0)
    failed = message.next_attempt(clock.time())
    retry = replace(failed, headers={"a": "1", "x-error": "boom"})
    transport.nack("g", retry, 5.0)
    assert transport.next_due("g", unique) == clock.time() + 5.0
    assert transport.pending("g", unique) == 1
    clock.advance(4.9)
    assert transport.fetch("g", unique, 1, 0) == []
    clock.advance(0.1)
    (again,) = transport.fetch("g", unique, 1, 0)
    assert (again.id, again.queue, again.offset, again.attempt) == (
        message.id,
        message.queue,
        message.offset,
        2,
    )
    assert again.first_failure_at == failed.first_failure_at
    assert dict(again.headers) == {"a": "1", "x-error": "boom"}
    assert transport.next_due("g", unique) is None
    transport.ack("g", [again])
    assert transport.pending("g", unique) == 0


def test_nack_with_no_delay_is_due_at_once(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(1))
    (message,) = transport.fetch("g", unique, 1, 0)
    transport.nack("g", message.next_attempt(clock.time()), 0)
    assert [m.attempt for m in transport.fetch("g", unique, 5, 0)] == [2]


def test_delayed_publish_is_not_due_before_its_time(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(1, prefix="late", delay=10.0) + outgoing(1, prefix="now"))
    assert [m.id for m in transport.fetch("g", unique, 5, 0)] == ["now0"]
    assert transport.pending("g", unique) == 2
    assert transport.next_due("g", unique) == clock.time() + 10.0
    clock.advance(10.0)
    assert [m.id for m in transport.fetch("g", unique, 5, 0)] == ["late0"]


def test_unacked_message_returns_after_visibility_timeout_same_attempt(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(2))
    first = transport.fetch("g", unique, 2, 0)
    transport.ack("g", first[:1])
    clock.advance(VISIBILITY - 1)
    assert transport.fetch("g", unique, 5, 0) == []
    assert transport.next_due("g", unique) is None  # a lease is not a scheduled redelivery
    clock.advance(1)
    (again,) = transport.fetch("g", unique, 5, 0)
    assert (again.id, again.attempt) == (first[1].id, 1)
    clock.advance(VISIBILITY - 1)
    assert transport.fetch("g", unique, 5, 0) == []  # leased anew


# dead letters


def test_dead_letter_removes_and_keeps_the_message(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(2))
    poison, good = sorted(transport.fetch("g", unique, 2, 0), key=lambda m: m.id)
    transport.dead_letter("g", poison, failure())
    transport.ack("g", [good])
    transport.ack("g", [poison])  # late ack of a dead letter: no-op
    clock.advance(VISIBILITY * 2)
    assert transport.fetch("g", unique, 5, 0) == []
    assert transport.pending("g", unique) == 0
    (dead,) = transport.dead_letter_queue("g")  # type: ignore[attr-defined]
    assert (dead.id, dead.topic, dead.queue, dead.offset, dead.payload) == (
        poison.id,
        unique,
        poison.queue,
        poison.offset,
        poison.payload,
    )
    (record,) = transport.dead_letter_records("g")  # type: ignore[attr-defined]
    assert record.failure == failure() and record.group == "g"
    assert transport.dead_letter_queue("other") == []  # type: ignore[attr-defined]


# waiting


def test_fetch_with_fake_clock_never_blocks_for_real(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    start = clock.time()
    assert transport.fetch("g", unique, 1, 0) == []
    assert clock.time() == start
    transport.publish(unique, outgoing(1, delay=2.0))
    (message,) = transport.fetch("g", unique, 1, 5.0)  # sleeps on the fake clock until due
    assert message.id == "m0"
    assert start + 2.0 <= clock.time() < start + 5.0
    assert transport.fetch("g", unique, 1, 1.0) == []
    assert clock.time() >= start + 3.0


def test_fetch_waits_for_a_publish(make_transport: MakeTransport, unique: str) -> None:
    transport = make_transport(SYSTEM_CLOCK)
    timer = threading.Timer(0.02, transport.publish, args=(unique, outgoing(1)))
    timer.start()
    try:
        assert [m.id for m in transport.fetch("g", unique, 1, 5.0)] == ["m0"]
    finally:
        timer.cancel()


# offsets


def test_seek_moves_the_group_cursor(transport: Transport, unique: str) -> None:
    transport.publish(unique, [OutgoingMessage(b"{}", key="same") for _ in range(5)])
    received = drain(transport, "g", unique)
    queue = received[0].queue
    transport.seek("g", {QueueRef(unique, queue): 3})
    assert sorted(m.offset for m in drain(transport, "g", unique)) == [3, 4]
    transport.commit("g", {QueueRef(unique, queue): 5})  # acks are per message: accepted, no effect
    assert transport.pending("g", unique) == 0


# opening by URL


def test_unknown_scheme_names_the_url_and_the_schemes() -> None:
    with pytest.raises(UnsupportedURLError, match=r"kafka://x.*memory://.*embedded://"):
        open_transport("kafka://x")


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigurationError, match="colour"):
        open_transport("memory://", colour="blue")
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        open_transport("memory://?visibility_timeout=-1")
