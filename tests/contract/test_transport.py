"""The `Transport` contract, once, over every transport (memory, embedded, Redis Streams).

Timing-dependent behaviour (delays, visibility timeout) runs on a `FakeClock`;
nothing here sleeps for real beyond a few milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
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

TRANSPORTS = ["memory", "embedded", "redis"]
VISIBILITY = 30.0
ROOT = Path(__file__).resolve().parents[2]

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


def test_seek_on_a_new_topic_starts_it_and_bad_places_are_named(
    transport: Transport, unique: str
) -> None:
    transport.seek("g", {QueueRef(unique, 0): 7})
    transport.publish(unique, [OutgoingMessage(b"{}", key="k")])
    assert [m.offset for m in drain(transport, "g", unique)] == [0]
    with pytest.raises(TransportError, match="no such place"):
        transport.seek("g", {QueueRef(unique, 99): 0})


# opening by URL


def test_unknown_scheme_names_the_url_and_the_schemes() -> None:
    with pytest.raises(UnsupportedURLError, match=r"kafka://x.*memory://.*embedded://"):
        open_transport("kafka://x")


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigurationError, match="colour"):
        open_transport("memory://", colour="blue")
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        open_transport("memory://?visibility_timeout=-1")
    with pytest.raises(ConfigurationError, match="no location"):
        open_transport("memory://somewhere")


def test_bad_embedded_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="synchronous='OFF'"):
        open_transport(f"embedded://{tmp_path}?synchronous=OFF")
    with pytest.raises(ConfigurationError, match="queues='x'"):
        open_transport(f"embedded://{tmp_path}?queues=x")


# embedded: durable, shared by processes

CHILD = """
import json, os, sys, time
from pathlib import Path
from backends.transport import open_transport

path, topic, mode, count = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
transport = open_transport(f"embedded://{path}", visibility_timeout=30.0)
if mode == "hold":  # fetch, report, then wait to be killed
    print(json.dumps([m.id for m in transport.fetch("g", topic, count, 0)]), flush=True)
    time.sleep(60)
print("ready", flush=True)
while not (path / "go").exists():
    time.sleep(0.002)
received = []
while messages := transport.fetch("g", topic, count, 0):
    if not received:  # hold the first claim until the other process holds one too
        (path / f"fetched-{os.getpid()}").touch()
        deadline = time.monotonic() + 10
        while len(list(path.glob("fetched-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
    received += [m.id for m in messages]
    transport.ack("g", messages)
print(json.dumps(received), flush=True)
"""


def start_child(path: Path, topic: str, mode: str, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), topic, mode, str(count)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_embedded_loses_nothing_when_a_fetcher_is_killed(tmp_path: Path, unique: str) -> None:
    path = tmp_path / "broker"
    open_transport(f"embedded://{path}").publish(unique, outgoing(50))
    child = start_child(path, unique, "hold", 20)
    try:
        held = json.loads(child.stdout.readline())  # type: ignore[union-attr]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert len(held) == 20
    clock = FakeClock(start=time.time())
    transport = open_transport(f"embedded://{path}", clock, visibility_timeout=VISIBILITY)
    rest = drain(transport, "g", unique)
    assert not {m.id for m in rest} & set(held)  # still leased to the dead process
    clock.advance(VISIBILITY + 1)
    again = drain(transport, "g", unique)
    assert sorted(m.id for m in again) == sorted(held) and {m.attempt for m in again} == {1}
    assert len(rest) + len(again) == 50 and transport.pending("g", unique) == 0


def test_two_processes_never_fetch_the_same_message(tmp_path: Path, unique: str) -> None:
    path = tmp_path / "broker"
    open_transport(f"embedded://{path}").publish(unique, outgoing(400))
    children = [start_child(path, unique, "drain", 10) for _ in range(2)]
    for child in children:
        assert child.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    (path / "go").touch()
    received = [json.loads(child.communicate(timeout=60)[0]) for child in children]
    everything = received[0] + received[1]
    assert len(everything) == len(set(everything)) == 400
    assert all(received)  # both took part


def test_embedded_state_survives_reopening(tmp_path: Path, unique: str, clock: FakeClock) -> None:
    url = f"embedded://{tmp_path / 'broker'}"
    first = open_transport(url, clock)
    first.publish(unique, outgoing(3))
    (fetched,) = first.fetch("g", unique, 1, 0)
    first.nack("g", fetched.next_attempt(clock.time()), 5.0)
    first.close()
    with pytest.raises(TransportError, match="closed"):
        first.fetch("g", unique, 1, 0)
    second = open_transport(url, clock)
    assert second.pending("g", unique) == 3
    assert second.next_due("g", unique) == clock.time() + 5.0
    clock.advance(5.0)
    received = drain(second, "g", unique)
    assert sorted((m.id, m.attempt) for m in received) == sorted(
        [(fetched.id, 2)] + [(f"m{n}", 1) for n in range(3) if f"m{n}" != fetched.id]
    )
    second.close()


def test_embedded_url_takes_relative_and_absolute_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = open_transport("embedded://./.reliable/broker")
    assert relative.path == Path(".reliable/broker/queue.db")  # type: ignore[attr-defined]
    assert (tmp_path / ".reliable/broker/queue.db").exists()
    absolute = open_transport(f"embedded://{tmp_path}/abs?queues=2")
    assert absolute.path == tmp_path / "abs/queue.db"  # type: ignore[attr-defined]
    absolute.publish("t", outgoing(4))
    assert {m.queue for m in drain(absolute, "g", "t")} == {0, 1}
    relative.close()
    absolute.close()
