"""Redis Streams entries another program appended with an id of its own (``XADD <stream> * ...``).

Such an entry sits above the transport's ``0-<offset + 1>`` layout; before
adoption, the next publish to the queue failed for good. The transport now
adopts it (moves it to the next offset, in arrival order) inside the script
that next appends to or reads the queue. Real Redis only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs

from backends.clock import FakeClock
from backends.errors import TransportError
from backends.transport.redis_streams import RedisStreamsTransport
from backends.types import Message, OutgoingMessage
from reliable.testing import test_app

HUGE = "9999999999999-5"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def transport(redis_url: str, unique: str, clock: FakeClock) -> Iterator[RedisStreamsTransport]:
    opened = RedisStreamsTransport(redis_url, clock, namespace=unique, queues=1)
    yield opened
    opened.purge()
    opened.close()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    opened = redis.Redis.from_url(redis_url)
    yield opened
    opened.close()


@pytest.fixture
def stream(unique: str) -> str:
    return f"{unique}:stream:orders:0"


def publish(transport: RedisStreamsTransport, *names: str, delay: float = 0.0) -> None:
    transport.publish(
        "orders", [OutgoingMessage(n.encode(), message_id=n, delay=delay) for n in names]
    )


def foreign(client: redis.Redis, stream: str, *names: str, id_: str = "*") -> None:
    for name in names:
        client.xadd(stream, {"id": name, "payload": name.encode()}, id=id_)


def drain(transport: RedisStreamsTransport, group: str) -> list[tuple[str, int]]:
    member = transport.subscribe(group, ["orders"])
    fetched: list[Message] = []
    while (batch := member.fetch(10, 0)) and len(fetched) < 1000:  # bounded: a bug cannot hang
        member.ack(batch)
        fetched += batch
    member.close()
    return [(m.id, m.offset) for m in fetched]


def assert_in_layout(client: redis.Redis, stream: str, unique: str) -> None:
    """Every entry at ``0-<offset + 1>``, contiguous; the head and Redis's own counters agree."""
    head = int(client.get(f"{unique}:head:orders:0") or 0)
    ids = [entry_id for entry_id, _ in client.xrange(stream)]
    assert ids == [f"0-{n}".encode() for n in range(1, head + 1)]
    info = client.xinfo_stream(stream)
    assert info["last-generated-id"] == f"0-{head}".encode()
    assert info["entries-added"] == head


def test_a_foreign_auto_id_entry_does_not_wedge_the_queue(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str
) -> None:
    publish(transport, "a")
    foreign(client, stream, "f")
    with capture_logs() as logs:
        publish(transport, "b")

    assert drain(transport, unique) == [("a", 0), ("f", 1), ("b", 2)]
    assert_in_layout(client, stream, unique)
    adopted = [e for e in logs if e["event"] == "transport.foreign_entries_adopted"]
    assert [(e["queue"], e["offset"], e["count"]) for e in adopted] == [(0, 1, 1)]
    publish(transport, "c")
    assert drain(transport, unique) == [("c", 3)]


def test_several_foreign_entries_and_a_huge_explicit_id_keep_their_arrival_order(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str
) -> None:
    publish(transport, "a")
    foreign(client, stream, "f1", "f2")
    foreign(client, stream, "huge", id_=HUGE)
    foreign(client, stream, "f3")  # Redis gives it 9999999999999-6: above the huge id
    publish(transport, "b", "c")

    assert drain(transport, unique) == [
        ("a", 0), ("f1", 1), ("f2", 2), ("huge", 3), ("f3", 4), ("b", 5), ("c", 6)
    ]
    assert_in_layout(client, stream, unique)


@pytest.mark.parametrize("top", ["0-9", "18446744073709551615-18446744073709551615"])
def test_an_explicit_id_up_to_the_largest_is_adopted(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str, top: str
) -> None:
    publish(transport, "a")
    foreign(client, stream, "f", id_=top)
    publish(transport, "b")

    assert drain(transport, unique) == [("a", 0), ("f", 1), ("b", 2)]
    assert_in_layout(client, stream, unique)


def test_a_fetch_adopts_before_it_reads_so_no_group_cursor_passes_an_entry(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str
) -> None:
    publish(transport, "a")
    assert drain(transport, "early") == [("a", 0)]
    foreign(client, stream, "f")
    member = transport.subscribe(unique, ["orders"])
    assert member.pending() == 2  # a, and f not yet adopted
    member.close()

    assert drain(transport, unique) == [("a", 0), ("f", 1)]
    publish(transport, "b")
    assert drain(transport, unique) == [("b", 2)]
    assert drain(transport, "early") == [("f", 1), ("b", 2)]
    assert_in_layout(client, stream, unique)


def test_leases_held_across_an_adoption_stay_valid(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str, clock: FakeClock
) -> None:
    publish(transport, "a", "b")
    member = transport.subscribe(unique, ["orders"])
    held = member.fetch(10, 0)
    foreign(client, stream, "f")
    publish(transport, "c")

    assert [(m.id, m.offset) for m in member.fetch(10, 0)] == [("f", 2), ("c", 3)]
    member.ack([held[0]])
    clock.advance(transport.visibility_timeout + 1)
    again = member.fetch(10, 0)
    assert [(m.id, m.offset, m.payload, m.attempt) for m in again] == [
        ("b", 1, b"b", 2), ("f", 2, b"f", 2), ("c", 3, b"c", 2)
    ]
    member.close()


def test_a_delayed_message_is_appended_after_the_adopted_entries(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str, clock: FakeClock
) -> None:
    publish(transport, "a")
    publish(transport, "later", delay=5)
    foreign(client, stream, "f")
    clock.advance(6)

    assert drain(transport, unique) == [("a", 0), ("f", 1), ("later", 2)]
    assert_in_layout(client, stream, unique)


def test_a_cursor_moved_past_the_layout_is_rewound_and_nothing_is_skipped(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str
) -> None:
    publish(transport, "a")
    assert drain(transport, unique) == [("a", 0)]
    foreign(client, stream, "f")
    # what a reader that does not adopt (this transport before it did) leaves behind
    client.xreadgroup(unique, "reliable", {stream: ">"}, noack=True)

    with capture_logs() as logs:
        publish(transport, "b")

    assert drain(transport, unique) == [("f", 1), ("b", 2)]
    rewound = [e for e in logs if e["event"] == "transport.group_cursor_rewound"]
    assert [(e["group"], e["offset"]) for e in rewound] == [(unique, 1)]


def test_an_id_left_on_top_by_a_deleted_foreign_entry_is_reset(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str
) -> None:
    publish(transport, "a")
    client.xdel(stream, client.xadd(stream, {"payload": b"gone"}))

    publish(transport, "b")

    assert drain(transport, unique) == [("a", 0), ("b", 1)]
    assert_in_layout(client, stream, unique)


def test_a_foreign_entry_on_a_queue_never_published_to(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str, unique: str
) -> None:
    transport.subscribe(unique, ["orders"]).close()  # creates the topic; its stream is empty
    foreign(client, stream, "f")

    assert drain(transport, unique) == [("f", 0)]
    publish(transport, "a")
    assert drain(transport, unique) == [("a", 1)]
    assert_in_layout(client, stream, unique)


def test_two_workers_race_producers_and_a_foreign_writer(
    redis_url: str, client: redis.Redis, stream: str, unique: str
) -> None:
    """Every message once, in arrival order per writer, while all four write and read at once."""
    count = 150
    transports = [
        RedisStreamsTransport(redis_url, FakeClock(), namespace=unique, queues=1) for _ in range(3)
    ]
    producer, workers = transports[0], transports[1:]
    publish(producer, "start")
    fetched: list[list[Message]] = [[], []]
    writing = threading.Event()
    writing.set()

    def work(number: int) -> None:
        member = workers[number].subscribe(unique, ["orders"])
        while len(fetched[number]) < 1000:
            written = not writing.is_set()  # read before the fetch: an empty fetch after it means all is read
            batch = member.fetch(7, 0)
            if not batch and written:
                break
            member.ack(batch)
            fetched[number] += batch
        member.close()

    def write_foreign() -> None:
        writer = redis.Redis.from_url(redis_url)
        for n in range(count):
            writer.xadd(stream, {"id": f"f{n}", "payload": b"f"})
        writer.close()

    threads = [threading.Thread(target=work, args=(n,), daemon=True) for n in range(2)]
    threads.append(threading.Thread(target=write_foreign, daemon=True))
    for thread in threads:
        thread.start()
    try:
        for n in range(count):
            publish(producer, f"p{n}")
    finally:
        threads[2].join(30)
        writing.clear()
        for thread in threads[:2]:
            thread.join(30)
    assert not any(thread.is_alive() for thread in threads)

    seen = sorted(fetched[0] + fetched[1], key=lambda m: m.offset)
    assert [m.offset for m in seen] == list(range(2 * count + 1))
    for prefix in ("p", "f"):
        ours = [m.id for m in seen if m.id.startswith(prefix)]
        assert ours == [f"{prefix}{n}" for n in range(count)]
    assert_in_layout(client, stream, unique)
    for opened in transports:
        opened.purge()
        opened.close()


def test_a_worker_run_until_idle_processes_an_entry_appended_after_it_went_idle(
    tmp_path: Path, redis_url: str, client: redis.Redis, stream: str, unique: str
) -> None:
    app = test_app(tmp_path, transport=f"{redis_url}?namespace={unique}&queues=1")
    done: list[str] = []

    @app.handler("orders", group=unique)
    def handle(msg, tx) -> None:
        done.append(msg.body["id"])

    app.publish("orders", {"id": "a"})
    app.run(until_idle=True)
    client.xadd(stream, {"payload": b'{"id": "f"}'})
    app.run(until_idle=True)

    assert done == ["a", "f"]
    app.close()


def test_an_append_refused_for_another_reason_still_fails_with_it(
    transport: RedisStreamsTransport, client: redis.Redis, stream: str
) -> None:
    client.set(stream, "not a stream")

    with pytest.raises(TransportError, match="WRONGTYPE"):
        publish(transport, "a")
