"""Leasing transports (memory, Redis Streams) in detail, on an injected clock.

The contract every transport keeps is `test_transport.py`; this suite adds
what the leasing transports promise beyond it, checked exactly on a
`FakeClock`: delays and leases to the second, the delivery count, cursors.
The broker behind ``embedded://`` has its own suite (`tests/broker/delivery/`).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backends.clock import SYSTEM_CLOCK, Clock, FakeClock
from backends.errors import ConfigurationError, TransportError, UnsupportedURLError
from backends.transport import open_transport
from backends.transport.base import SubscribeOptions, Subscription, Transport
from backends.types import Failure, Message, OutgoingMessage, QueueRef
from tests.contract.transports import LEASING, TRANSPORTS

VISIBILITY = 30.0
ROOT = Path(__file__).resolve().parents[2]

MakeTransport = Callable[..., Transport]


@pytest.fixture(params=LEASING)
def make_transport(request, tmp_path: Path, unique: str) -> Iterator[MakeTransport]:
    """Opens transports of one kind sharing one place (directory / Redis namespace)."""
    opened: list[Transport] = []
    url, _ = TRANSPORTS[request.param](request, tmp_path, unique)

    def make(clock: Clock = SYSTEM_CLOCK, **options) -> Transport:
        options.setdefault("visibility_timeout", VISIBILITY)
        transport = open_transport(url, clock, **options)
        opened.append(transport)
        return transport

    yield make
    _members.clear()
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


_members: dict[tuple[int, str, str], Subscription] = {}


def member(transport: Transport, group: str, topic: str) -> Subscription:
    """The test's member of ``group`` on ``topic`` (one per transport, group and topic)."""
    key = (id(transport), group, topic)
    if key not in _members:
        _members[key] = transport.subscribe(group, [topic])
    return _members[key]


def drain(transport: Transport, group: str, topic: str, batch: int = 10) -> list[Message]:
    """Fetch and ack until nothing is due."""
    received: list[Message] = []
    subscription = member(transport, group, topic)
    while messages := subscription.fetch(batch, 0):
        subscription.ack(messages)
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
        assert message.queue == zlib.crc32(str(message.key).encode()) % 4
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
        member(transport, "g", unique).fetch(0, 0)
    with pytest.raises(TransportError, match="topic"):
        transport.publish("", outgoing(1))


# fetching: once per group, one fetcher at a time


def test_each_group_gets_every_message_once(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(25))
    for group in ("billing", "audit"):
        assert sorted(m.id for m in drain(transport, group, unique, batch=7)) == sorted(
            f"m{n}" for n in range(25)
        )
        assert member(transport, group, unique).fetch(10, 0) == []


def test_concurrent_fetchers_never_share_a_message(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(400))
    seen: list[list[str]] = [[] for _ in range(4)]

    def consume(index: int) -> None:
        while messages := member(transport, "g", unique).fetch(7, 0):
            seen[index] += [m.id for m in messages]
            member(transport, "g", unique).ack(messages)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [message_id for ids in seen for message_id in ids]
    assert len(everything) == len(set(everything)) == 400


def test_fetch_respects_max_messages_and_pending_counts(transport: Transport, unique: str) -> None:
    transport.publish(unique, outgoing(10))
    assert member(transport, "g", unique).pending() == 10
    batch = member(transport, "g", unique).fetch(4, 0)
    assert len(batch) == 4
    assert member(transport, "g", unique).pending() == 10  # in flight still counts
    member(transport, "g", unique).ack(batch)
    assert member(transport, "g", unique).pending() == 6
    assert member(transport, "other", unique).pending() == 10
    assert member(transport, "g", "never-published").pending() == 0


# acks


def test_ack_is_idempotent_and_final(transport: Transport, clock: FakeClock, unique: str) -> None:
    transport.publish(unique, outgoing(3))
    batch = member(transport, "g", unique).fetch(3, 0)
    member(transport, "g", unique).ack(batch)
    member(transport, "g", unique).ack(batch)  # again: no-op
    member(transport, "g", unique).ack([Message("nope", unique, 0, 999, b"{}")])  # unknown: no-op
    member(transport, "g", unique).nack(batch[0], 0)  # late nack: no resurrection
    clock.advance(VISIBILITY * 2)
    assert member(transport, "g", unique).fetch(10, 0) == []
    assert member(transport, "g", unique).pending() == 0


def test_nack_redelivers_after_delay_counting_the_delivery(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(1, headers={"a": "1"}))
    g = member(transport, "g", unique)
    (message,) = g.fetch(1, 0)
    failed_at = clock.time()
    g.nack(message, 5.0)
    assert g.next_due() == clock.time() + 5.0
    assert g.pending() == 1
    clock.advance(4.9)
    assert g.fetch(1, 0) == []
    clock.advance(0.1)
    (again,) = g.fetch(1, 0)
    assert (again.id, again.queue, again.offset, again.attempt) == (
        message.id,
        message.queue,
        message.offset,
        2,
    )
    assert again.first_failure_at == failed_at
    assert dict(again.headers) == {"a": "1"}
    assert g.next_due() is None
    clock.advance(1.0)
    g.nack(again, 1.0)
    clock.advance(1.0)
    (third,) = g.fetch(1, 0)
    assert (third.attempt, third.first_failure_at) == (3, failed_at)  # the first failure is kept
    g.ack([third])
    assert g.pending() == 0


def test_nack_with_no_delay_is_due_at_once(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(1))
    (message,) = member(transport, "g", unique).fetch(1, 0)
    member(transport, "g", unique).nack(message, 0)
    assert [m.attempt for m in member(transport, "g", unique).fetch(5, 0)] == [2]


def test_delayed_publish_is_not_due_before_its_time(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(1, prefix="late", delay=10.0) + outgoing(1, prefix="now"))
    assert [m.id for m in member(transport, "g", unique).fetch(5, 0)] == ["now0"]
    assert member(transport, "g", unique).pending() == 2
    assert member(transport, "g", unique).next_due() == clock.time() + 10.0
    clock.advance(10.0)
    assert [m.id for m in member(transport, "g", unique).fetch(5, 0)] == ["late0"]


def test_unacked_message_returns_after_visibility_timeout_counted(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(2))
    first = member(transport, "g", unique).fetch(2, 0)
    member(transport, "g", unique).ack(first[:1])
    clock.advance(VISIBILITY - 1)
    assert member(transport, "g", unique).fetch(5, 0) == []
    assert member(transport, "g", unique).next_due() is None  # a lease is not a scheduled redelivery
    clock.advance(1)
    (again,) = member(transport, "g", unique).fetch(5, 0)
    assert (again.id, again.attempt) == (first[1].id, 2)  # the delivery counts
    clock.advance(VISIBILITY - 1)
    assert member(transport, "g", unique).fetch(5, 0) == []  # leased anew


# dead letters


def test_dead_letter_removes_and_keeps_the_message(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    transport.publish(unique, outgoing(2))
    poison, good = sorted(member(transport, "g", unique).fetch(2, 0), key=lambda m: m.id)
    member(transport, "g", unique).dead_letter(poison, failure())
    member(transport, "g", unique).ack([good])
    member(transport, "g", unique).ack([poison])  # late ack of a dead letter: no-op
    clock.advance(VISIBILITY * 2)
    assert member(transport, "g", unique).fetch(5, 0) == []
    assert member(transport, "g", unique).pending() == 0
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
    assert member(transport, "g", unique).fetch(1, 0) == []
    assert clock.time() == start
    transport.publish(unique, outgoing(1, delay=2.0))
    (message,) = member(transport, "g", unique).fetch(1, 5.0)  # sleeps on the fake clock until due
    assert message.id == "m0"
    assert start + 2.0 <= clock.time() < start + 5.0
    assert member(transport, "g", unique).fetch(1, 1.0) == []
    assert clock.time() >= start + 3.0


def test_fetch_waits_for_a_publish(make_transport: MakeTransport, unique: str) -> None:
    transport = make_transport(SYSTEM_CLOCK)
    timer = threading.Timer(0.02, transport.publish, args=(unique, outgoing(1)))
    timer.start()
    try:
        assert [m.id for m in member(transport, "g", unique).fetch(1, 5.0)] == ["m0"]
    finally:
        timer.cancel()


# offsets


def test_assignment_seeks_to_the_offsets_on_assign_returns(
    transport: Transport, unique: str
) -> None:
    transport.publish(unique, [OutgoingMessage(b"{}", key="same") for _ in range(5)])
    received = drain(transport, "g", unique)
    ref = QueueRef(unique, received[0].queue)
    assigned: list[QueueRef] = []

    def on_assign(queues):
        assigned.extend(queues)
        return {ref: 3}

    with transport.subscribe("g", [unique], SubscribeOptions(on_assign=on_assign)) as again:
        assert ref in assigned and QueueRef("%RETRY%g", 0) in assigned
        assert sorted(m.offset for m in again.fetch(10, 0)) == [3, 4]


def test_a_seek_forgets_first_deliveries_in_flight_below_it_but_not_redeliveries(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    """The saved offset a member seeks to says the messages below it are done, or were handed back
    to wait in the transport (a nack): one of those claimed again is in flight below it, not done,
    and a member killed with it in hand must not lose it to the seek of the restart."""
    transport.publish(unique, [OutgoingMessage(b"{}", key="same") for _ in range(4)])
    dead = transport.subscribe("g", [unique])
    first = sorted(dead.fetch(4, 0), key=lambda m: m.offset)
    ref = QueueRef(unique, first[0].queue)
    dead.nack(first[0], 0)  # handed back: the worker's position passes it
    dead.ack(first[2:])
    (again,) = dead.fetch(4, 0)
    assert (again.offset, again.attempt) == (0, 2)  # in flight below the saved offset, 1 too (done, not acked)
    with transport.subscribe("g", [unique], SubscribeOptions(on_assign=lambda queues: {ref: 4})) as restarted:
        assert restarted.fetch(4, 0) == []
        clock.advance(VISIBILITY + 1)  # the dead member's leases end
        back = restarted.fetch(4, 0)
        assert [(m.offset, m.attempt) for m in back] == [(0, 3)]  # lost to the seek before
        restarted.ack(back)
        assert restarted.pending() == 0


def test_commit_records_the_position_and_never_moves_it_back(
    transport: Transport, unique: str
) -> None:
    g = member(transport, "g", unique)
    if not g.capabilities.consumer_offsets:
        with pytest.raises(TransportError, match="consumer offsets"):
            g.commit({QueueRef(unique, 0): 5})
        return
    g.commit({QueueRef(unique, 0): 5})
    g.commit({QueueRef(unique, 0): 3})
    assert transport.committed("g", unique) == {0: 5}  # type: ignore[attr-defined]


def test_what_the_group_finished_is_held_by_any_members_lease_alone(
    transport: Transport, clock: FakeClock, unique: str
) -> None:
    """Every member reads every queue: the group's finished prefix is the transport's to tell,
    across members; a lease holds it, a dead member's or not, but the asking member's own do not
    (it knows them), nor does a scheduled redelivery."""
    ref = QueueRef(unique, zlib.crc32(b"same") % 4)
    transport.publish(unique, [OutgoingMessage(b"{}", key="same") for _ in range(8)])
    first, second = transport.subscribe("g", [unique]), transport.subscribe("g", [unique])

    def below(member: Subscription, *mine: int) -> int | None:
        return member.finished_below({ref: set(mine)}).get(ref)  # type: ignore[attr-defined]

    assert below(first) == 0
    taken = [first.fetch(2, 0), second.fetch(2, 0), first.fetch(2, 0)]  # 0-1, 2-3, 4-5
    assert below(first) == 0 and below(first, 0, 1, 4, 5) == 2 and below(second, 2, 3) == 0
    first.ack(taken[0])
    assert below(second) == 2 and below(second, 2, 3) == 4
    second.nack(taken[1][0], 60)  # waits in the transport: the position may pass it
    second.dead_letter(taken[1][1], failure())
    assert below(first) == 4 and below(first, 4, 5) == 6
    first.close()  # left with 4-5 in hand: they hold the group until another member finishes them
    clock.advance(VISIBILITY + 1)
    assert below(second) == 4
    again = sorted(second.fetch(10, 0), key=lambda m: m.offset)
    assert [m.offset for m in again] == [4, 5, 6, 7]  # the nacked one is due later
    second.ack(again[:1])
    assert below(second) == 5 and below(second, 5, 6, 7) == 8
    assert second.finished_below({QueueRef(unique, 99): set()}) == {}  # type: ignore[attr-defined]
    second.ack(again[1:])
    assert below(second) == 8


def test_assignment_on_a_new_topic_starts_it_and_bad_places_are_named(
    transport: Transport, unique: str
) -> None:
    options = SubscribeOptions(on_assign=lambda queues: {QueueRef(unique, 0): 7})
    transport.subscribe("g", [unique], options).close()
    transport.publish(unique, [OutgoingMessage(b"{}", key="k")])
    assert [m.offset for m in drain(transport, "g", unique)] == [0]
    with pytest.raises(TransportError, match="no such place"):
        transport._seek("g", {QueueRef(unique, 99): 0})  # type: ignore[attr-defined]


# opening by URL


def test_unknown_scheme_names_the_url_and_the_schemes() -> None:
    with pytest.raises(UnsupportedURLError, match=r"nope://x.*memory://.*embedded://"):
        open_transport("nope://x")


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigurationError, match="colour"):
        open_transport("memory://", colour="blue")
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        open_transport("memory://?visibility_timeout=-1")
    with pytest.raises(ConfigurationError, match="no location"):
        open_transport("memory://somewhere")
