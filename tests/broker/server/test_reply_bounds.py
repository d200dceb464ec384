"""What one native request or connection makes the server hold for its replies is bounded.

* A reply holds at most ``max_fetch_messages``: a ``read`` (``fetch``, ``dlq_list``,
  ``lookup_key``) asking for a billion messages read the whole queue into memory and encoded it
  as one frame.
* A connection runs at most ``max_waiting_requests`` requests that wait (fetch, read, ...) beside
  its others; past that a request is refused at once, and the connection serves on. Each such
  request holds its reply until the client has read it: a client that pipelined thousands of reads
  and never read a reply made the server hold every reply at once (the requests are small, so the
  read-ahead bound let thousands in), until ``slow_client_timeout`` cut it off.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import Client
from broker.delivery.config import DeliveryConfig
from broker.delivery.values import OutgoingMessage
from broker.protocol import codec as native_codec
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.threaded import replies

LIMIT = 4
POLL = 2.0  # seconds each long poll waits for a message that never comes
MAX_FETCH = 10


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, max_waiting_requests=LIMIT,
                          max_fetch_messages=MAX_FETCH) as started:
        yield started


def test_long_polls_past_the_limit_are_refused_at_once_and_the_others_still_answered(server, unique) -> None:
    with socket.create_connection(("127.0.0.1", server.port("native")), timeout=30) as sock:
        sock.sendall(native_codec.encode({"id": 1, "op": "subscribe", "group": unique, "topics": [unique]}))
        [joined] = replies(sock, 1)
        polls = [native_codec.encode({"id": n, "op": "fetch", "member": joined["member"], "timeout": POLL})
                 for n in range(2, LIMIT + 5)]
        sock.sendall(b"".join(polls) + native_codec.encode({"id": 99, "op": "ping"}))
        answered = replies(sock, len(polls) + 1)
    refused = [(r["id"], r["error"]["code"], r["fatal"]) for r in answered if not r["ok"]]
    assert refused == [(n, "limit_exceeded", False) for n in range(LIMIT + 2, LIMIT + 5)]
    assert answered[:len(refused) + 1] == [*(r for r in answered if not r["ok"]), {"id": 99, "ok": True}]
    assert sorted(r["id"] for r in answered if r["ok"] and r["id"] != 99) == list(range(2, LIMIT + 2))
    assert "max_waiting_requests=4" in answered[0]["error"]["message"]


def test_a_client_polling_within_the_limit_is_served_as_before(server, unique) -> None:
    client = Client(threaded.native(server))
    member = client.join(unique, [unique])
    assert client.fetch(member, 10, 0.1) == []
    client.close()


def test_a_reply_holds_at_most_max_fetch_messages_however_many_are_asked_for(server, unique) -> None:
    client = Client(threaded.native(server))
    client.publish(unique, [OutgoingMessage(f"m{n}".encode(), queue=0) for n in range(3 * MAX_FETCH)])
    assert len(client.read(unique, 0, 0, 1_000_000_000)) == MAX_FETCH
    assert len(client.read_columns(unique, 0, MAX_FETCH, 1_000_000_000).column("offset")) == MAX_FETCH
    member = client.join(unique, [unique], prefetch=1_000_000_000)
    taken = client.fetch(member, 1_000_000_000, 0.0)
    assert len(taken) == MAX_FETCH  # the rest is fetched next, as with any "up to"
    assert client.fetch(member, 1_000_000_000, 0.0) == []  # the prefetch window is MAX_FETCH too
    client.ack(member, [d.receipt for d in taken])
    assert len(client.fetch(member, 1_000_000_000, 0.0)) == MAX_FETCH
    client.close()


def test_a_reply_holds_at_most_max_fetch_bytes_of_messages_and_at_least_one(tmp_path, unique) -> None:
    """Ten thousand messages of 1 MiB were one 10 GiB reply; Kafka cuts a fetch at fetch.max.bytes."""
    body = 100_000
    with threaded.serving(tmp_path, FakeClock(), {}, delivery=DeliveryConfig(max_fetch_bytes=int(2.5 * body))) as server:
        client = Client(threaded.native(server))
        client.publish(unique, [OutgoingMessage(bytes([n]) * body, queue=0) for n in range(7)])
        assert [d.offset for d in client.read(unique, 0, 0, 1000)] == [0, 1]  # a third would pass the bytes
        assert client.read_columns(unique, 0, 2, 1000).column("offset") == [2, 3]
        member = client.join(unique, [unique])
        taken = client.fetch(member, 1000, 0.0)
        assert [d.body[0] for d in taken] == [0, 1]
        client.ack(member, [d.receipt for d in taken])
        assert [d.body[0] for d in client.fetch(member, 1000, 0.0)] == [2, 3]
        client.close()
    with threaded.serving(tmp_path / "small", FakeClock(), {}, delivery=DeliveryConfig(max_fetch_bytes=10)) as server:
        client = Client(threaded.native(server))  # every message is larger than the bound: one at a time
        client.publish(unique, [OutgoingMessage(b"x" * 100, queue=0) for _ in range(3)])
        assert len(client.read(unique, 0, 0, 1000)) == 1
        member = client.join(unique, [unique])
        assert len(client.fetch(member, 1000, 0.0)) == 1
        client.close()


def test_a_client_with_more_members_polling_than_the_limit_takes_turns_instead_of_failing(server, unique) -> None:
    """A process whose members poll at once past ``max_waiting_requests`` on one connection (a
    worker with many handlers on ``reliable://``): its polls were refused (``limit_exceeded``, a
    `TransportError` out of the worker's fetch). The client learns the limit at hello, and the
    polls past it wait their turn in the client."""
    client = Client(threaded.native(server))
    members = [client.join(f"{unique}-{n}", [unique]) for n in range(3 * LIMIT)]
    failures: list[Exception] = []

    def poll(member: str) -> None:
        try:
            client.fetch(member, 1, 1.0)  # all start within the second: more than LIMIT wait at once
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            failures.append(exc)

    polling = [threading.Thread(target=poll, args=(member,)) for member in members]
    for thread in polling:
        thread.start()
    for thread in polling:
        thread.join()
    client.close()
    assert failures == []
