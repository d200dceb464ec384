"""The `Transport` contract, written once, run on every transport in `transports.TRANSPORTS`.

Real servers, real clock: waits are bounded polls, never sleeps to
synchronise, and nothing here asserts how fast anything is. Optional
capabilities are tested where a transport declares them.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backends.errors import BackendUnavailableError, TransportError
from backends.transport import open_transport
from backends.transport.base import SubscribeOptions, Subscription, Transport
from backends.types import Failure, Message, OutgoingMessage, text_bytes, text_from_bytes
from tests.contract.transports import TRANSPORTS

WAIT = 20.0  # the longest any expected message may take to arrive


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[Transport]:
    url, options = TRANSPORTS[request.param](request, tmp_path, unique)
    opened = open_transport(url, **options)
    yield opened
    if hasattr(opened, "purge"):
        opened.purge()
    opened.close()


@pytest.fixture
def members(transport: Transport) -> Iterator[Callable[..., Subscription]]:
    """Opens members (subscriptions) and closes them after the test."""
    opened: list[Subscription] = []

    def join(group: str, topic: str, **options) -> Subscription:
        subscription = transport.subscribe(group, [topic], SubscribeOptions(**options))
        opened.append(subscription)
        return subscription

    yield join
    for subscription in opened:
        subscription.close()


def outgoing(count: int, prefix: str = "m", **fields) -> list[OutgoingMessage]:
    return [OutgoingMessage(f'{{"n":{n}}}'.encode(), message_id=f"{prefix}{n}", **fields) for n in range(count)]


def receive(member: Subscription, count: int, ack: bool = True, wait: float = WAIT) -> list[Message]:
    """Fetch until ``count`` messages arrived (acking them) or ``wait`` seconds passed."""
    received: list[Message] = []
    deadline = time.monotonic() + wait
    while len(received) < count and time.monotonic() < deadline:
        messages = member.fetch(count - len(received), 0.2)
        if ack and messages:
            member.ack(messages)
        received += messages
    return received


def quiet(member: Subscription, seconds: float = 0.5) -> list[Message]:
    """What arrives within ``seconds`` when nothing should."""
    return receive(member, 1, ack=False, wait=seconds)


def failure() -> Failure:
    return Failure("ValueError", "bad", "Traceback ...", 3, 1.0, 2.0)


def test_each_message_reaches_a_group_once_as_published(transport: Transport, members, unique: str) -> None:
    g = members("g", unique)
    transport.publish(unique, [OutgoingMessage(b"\x00\xffraw", key="k", headers={"h": "v"}, message_id="id-1")])
    transport.publish(unique, outgoing(9))
    received = receive(g, 10)
    assert sorted(m.id for m in received) == sorted(["id-1"] + [f"m{n}" for n in range(9)])
    first = next(m for m in received if m.id == "id-1")
    assert (first.payload, first.key, first.headers.get("h"), first.attempt) == (b"\x00\xffraw", "k", "v", 1)
    assert {m.attempt for m in received} == {1}
    assert quiet(g) == []  # acked: never again


def test_every_group_gets_every_message(transport: Transport, members, unique: str) -> None:
    billing, audit = members("billing", unique), members("audit", unique)
    transport.publish(unique, outgoing(20))
    for group in (billing, audit):
        assert sorted(m.id for m in receive(group, 20)) == sorted(f"m{n}" for n in range(20))


def settled(team: list) -> None:
    """Kafka members join their group inside poll: poll until every one holds partitions and the
    assignment stayed put for two seconds, so the messages meet a settled group (a commit that a
    rebalance refuses repeats messages on Kafka: what the framework's tokens absorb)."""
    if not all(hasattr(member, "_assigned") for member in team):
        return  # the other engines assign at join
    deadline, last, since = time.monotonic() + 60, None, time.monotonic()
    while time.monotonic() < deadline:
        for member in team:
            member.fetch(1, 0.05)
        now = [frozenset(member._assigned) for member in team]
        if now != last:
            last, since = now, time.monotonic()
        elif all(now) and time.monotonic() - since >= 2:
            return
    raise AssertionError(f"the group never settled: {last}")


def test_members_of_a_group_never_share_a_message(transport: Transport, members, unique: str) -> None:
    team = [members("g", unique) for _ in range(3)]
    settled(team)
    transport.publish(unique, outgoing(300))
    seen: list[list[str]] = [[] for _ in team]

    def consume(index: int) -> None:
        deadline = time.monotonic() + WAIT
        while sum(map(len, seen)) < 300 and time.monotonic() < deadline:
            messages = team[index].fetch(10, 0.1)
            team[index].ack(messages)
            seen[index] += [m.id for m in messages]

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(team))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [message_id for ids in seen for message_id in ids]
    assert len(everything) == len(set(everything)) == 300


def test_nack_redelivers_after_the_delay_counting_the_delivery(transport: Transport, members, unique: str) -> None:
    g = members("g", unique)
    transport.publish(unique, outgoing(1))
    (message,) = receive(g, 1, ack=False)
    nacked_at = time.monotonic()
    g.nack(message, 1.0)
    (again,) = receive(g, 1, ack=False)
    assert time.monotonic() - nacked_at >= 0.9  # not before its delay (timer granularity aside)
    assert (again.id, again.payload, again.attempt) == (message.id, message.payload, 2)
    g.nack(again, 0.0)
    (third,) = receive(g, 1)
    assert third.attempt == 3
    assert quiet(g) == []


def test_dead_letter_is_final(transport: Transport, members, unique: str) -> None:
    g = members("g", unique)
    transport.publish(unique, outgoing(2))
    poison, good = sorted(receive(g, 2, ack=False), key=lambda m: m.id)
    g.dead_letter(poison, failure())
    g.ack([good])
    assert quiet(g) == []


def test_a_message_sent_to_a_group_reaches_only_that_group(transport: Transport, members, unique: str) -> None:
    failing, other = members("failing", unique), members("other", unique)
    transport.publish(unique, outgoing(1))
    receive(failing, 1), receive(other, 1)
    transport.publish_to_group("failing", unique, [OutgoingMessage(b'{"n":0}', message_id="replayed")])
    (replayed,) = receive(failing, 1)
    assert (replayed.id, replayed.payload) == ("replayed", b'{"n":0}')
    assert quiet(other) == []


def test_an_unacked_message_goes_to_another_member_when_its_member_leaves(
    transport: Transport, members, unique: str
) -> None:
    first = members("g", unique, lease=1.0)
    transport.publish(unique, outgoing(1))
    (held,) = receive(first, 1, ack=False)
    first.close()
    second = members("g", unique, lease=1.0)
    (again,) = receive(second, 1)
    assert again.id == held.id and again.attempt >= 2


def test_a_delayed_publish_arrives_after_its_delay(transport: Transport, members, unique: str) -> None:
    g = members("g", unique)
    published_at = time.monotonic()
    transport.publish(unique, outgoing(1, prefix="late", delay=1.0) + outgoing(1, prefix="now"))
    arrived: dict[str, float] = {}
    deadline = time.monotonic() + WAIT
    while len(arrived) < 2 and time.monotonic() < deadline:
        messages = g.fetch(2, 0.2)
        g.ack(messages)
        arrived.update({m.id: time.monotonic() - published_at for m in messages})
    assert sorted(arrived) == ["late0", "now0"]
    assert arrived["late0"] >= 0.9  # never before its delay (timer granularity aside)


def test_pending_counts_what_is_left_where_declared(transport: Transport, members, unique: str) -> None:
    g = members("g", unique)
    if not g.capabilities.drain:
        pytest.skip(f"{type(transport).__name__} does not declare drain")
    transport.publish(unique, outgoing(5))
    batch = receive(g, 2, ack=False)
    assert g.pending() == 5  # in flight still counts
    g.ack(batch)
    assert g.pending() == 3
    receive(g, 3)
    assert g.pending() == 0


def test_closed_subscriptions_refuse_calls(transport: Transport, members, unique: str) -> None:
    g = members("g", unique)
    g.close()
    with pytest.raises(Exception, match="closed"):
        g.fetch(1, 0)


def test_binary_keys_and_header_values_go_out_exactly_or_are_refused_by_name(
    transport: Transport, members, unique: str
) -> None:
    """A key or header value read from bytes that are not UTF-8 (`text_from_bytes`: another
    program's Kafka record) is sent back with those bytes where they travel as bytes, else
    refused naming it, nothing of the call sent."""
    g = members("g", unique)
    raw = text_from_bytes(b"\x00k\x80\xff")
    if transport.binary_fields:
        transport.publish(unique, outgoing(1, key=raw, headers={"h": raw}))
        (message,) = receive(g, 1)
        assert text_bytes(message.key or "") == text_bytes(message.headers["h"]) == b"\x00k\x80\xff"
    else:
        for fields, named in (({"key": raw}, "message key"), ({"headers": {"h": raw}}, "header 'h'")):
            with pytest.raises(TransportError, match=rf"{named} '\\x00k\\x80\\xff' holds bytes that are not UTF-8"):
                transport.publish(unique, [*outgoing(1, "first"), *outgoing(1, **fields)])
        assert quiet(g) == []
    for fields in ({"key": "\ud800"}, {"headers": {"h": "\ud800"}}):  # stands for no byte: refused everywhere
        with pytest.raises(TransportError, match="lone surrogate"):
            transport.publish(unique, outgoing(1, **fields))


AWKWARD_HEADERS = {"line": "one\ntwo", "crlf": "a\r\nb", "padded": " x ", "": "an empty name",
                   "größe": "ü", "a b": "v", "a:b": "v", "n" * 300: "a name above AMQP's 255 bytes",
                   "nul": "a\x00b", "a\x00b": "a NUL in the name", "tab": "a\tb", "del": "a\x7fb"}


def test_headers_arrive_as_given_or_are_refused_by_name(transport: Transport, members, unique: str) -> None:
    """Never changed or dropped in silence: nats-py trims values, turns their line breaks into
    spaces and skips an empty name; nats:// refuses those, naming the header."""
    g = members("g", unique)
    sent = {}
    for n, (name, value) in enumerate(AWKWARD_HEADERS.items()):
        try:
            transport.publish(unique, [OutgoingMessage(b"x", headers={name: value}, message_id=f"h{n}")])
        except BackendUnavailableError:  # an outage: what a caller retries for ever
            raise
        except TransportError as exc:
            assert repr(name)[:60] in str(exc)  # a long name by its start
        else:
            sent[f"h{n}"] = (name, value)
    for message in receive(g, len(sent)):
        name, value = sent.pop(message.id)
        assert message.headers.get(name) == value
    assert sent == {}


NOT_CARRIED: list[tuple[dict[str, object], str]] = [
    ({"key": 5}, "message key 5: a str is required"),
    ({"message_id": 5}, "message id 5: a str is required"),
    ({"headers": {"h": 5}}, "header 'h' 5: a str is required"),
    ({"headers": {"h": b"v"}}, "header 'h' b'v': a str is required"),
    ({"headers": {"h": None}}, "header 'h' None: a str is required"),
    ({"headers": {5: "v"}}, "header name 5: a str"),
    ({"headers": {text_from_bytes(b"h\xff"): "v"}}, "header name 'h\\xff': a str with a UTF-8 form"),
    ({"delay": float("nan")}, "message delay nan: must be a finite number"),
    ({"delay": float("inf")}, "message delay inf: must be a finite number"),
]


def test_fields_no_wire_carries_are_refused_by_name_and_nothing_is_sent(
    transport: Transport, members, unique: str
) -> None:
    """A key, id, header name or value that is not a str, a header name with no UTF-8 form, a delay
    that is no number of seconds: each client library failed in a way of its own (AttributeError,
    pika's AssertionError; librdkafka crashed the process on the header name, so a relay restarted
    into the same crash on that outbox row). Now a `TransportError` naming it, for the whole call."""
    g = members("g", unique)
    for fields, named in NOT_CARRIED:
        with pytest.raises(TransportError, match=re.escape(named)):
            transport.publish(unique, [*outgoing(1, "first"), OutgoingMessage(b"x", **fields)])  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="lone surrogate"):
        transport.publish(text_from_bytes(b"t\xff"), outgoing(1))
    for topic in ("%RETRY%g", "%DLQ%g"):  # a group's own queue: Redis and memory took a publish to it
        with pytest.raises(TransportError, match=re.escape(topic)):
            transport.publish(topic, outgoing(1))
    assert quiet(g) == []
    try:  # above AMQP's 255 bytes for a short string: pika's own error
        transport.publish(unique, [OutgoingMessage(b"x", message_id="i" * 300)])
    except BackendUnavailableError:
        raise
    except TransportError as exc:
        assert "message id 'iii" in str(exc)
    else:
        assert [m.id for m in receive(g, 1)] == ["i" * 300]


AWKWARD_TEXT = ["one\ntwo", "a\r\nb", " x ", "a\x00b", "größe", "a\tb", "x" * 300]


def test_keys_and_message_ids_arrive_as_given_or_are_refused_by_name(
    transport: Transport, members, unique: str
) -> None:
    """The key and the message id travel in a field or a header of each wire: never changed in
    silence (this held on every transport)."""
    g = members("g", unique)
    sent: set[tuple[str | None, str]] = set()
    for n, text in enumerate(AWKWARD_TEXT):
        for key, message_id in ((text, f"k{n}"), (f"i{n}", text)):
            try:
                transport.publish(unique, [OutgoingMessage(b"x", key=key, message_id=message_id)])
            except BackendUnavailableError:
                raise
            except TransportError as exc:
                assert "message id" in str(exc) or repr(text)[1:20] in str(exc), exc
            else:
                sent.add((key, message_id))
    assert {(m.key, m.id) for m in receive(g, len(sent))} == sent


def test_an_empty_payload_key_and_header_arrive_empty_or_are_refused_by_name(
    transport: Transport, members, unique: str
) -> None:
    """The broker keeps no key as an empty one: an empty key arrived as None (no key, so in no
    key's order), changed in silence; it refuses it now, naming it."""
    g = members("g", unique)
    try:
        transport.publish(unique, [OutgoingMessage(b"", key="", headers={"h": ""}, message_id="empty")])
    except BackendUnavailableError:
        raise
    except TransportError as exc:
        assert "message key ''" in str(exc)
        transport.publish(unique, [OutgoingMessage(b"", headers={"h": ""}, message_id="empty")])
        (message,) = receive(g, 1)
        assert (message.payload, message.key, message.headers.get("h")) == (b"", None, "")
    else:
        (message,) = receive(g, 1)
        assert (message.payload, message.key, message.headers.get("h")) == (b"", "", "")


def test_a_message_too_large_for_the_wire_is_refused_and_publishing_goes_on(
    transport: Transport, members, unique: str
) -> None:
    """A header beyond AMQP's frame_max or JetStream's 64 KiB, a body beyond the broker server's
    frame or NATS's max_payload: each closed the connection or went unanswered, an outage that a
    caller (the outbox relay) retries for ever. Now refused naming the limit, and the next publish
    goes through."""
    g = members("g", unique)
    accepted = ["after"]
    for message in (OutgoingMessage(b"x", headers={"big": "x" * 1_000_000}, message_id="big-header"),
                    OutgoingMessage(b"x" * 20_000_000, message_id="big-body")):
        try:
            transport.publish(unique, [message])
        except BackendUnavailableError:
            raise
        except TransportError as exc:
            assert re.search(r"max|limit|large", str(exc)), exc
        else:
            accepted.append(message.message_id)
    transport.publish(unique, [OutgoingMessage(b"x", message_id="after")])
    assert sorted(m.id for m in receive(g, len(accepted))) == sorted(accepted)


def test_a_batch_larger_than_any_frame_is_published_whole(transport: Transport, members, unique: str) -> None:
    """9 MB in one call (450 messages of 20 KB, the outbox relay's batch): above the broker server's
    8 MiB frame, so reliable:// sends it in several frames (it lost the connection every time)."""
    g = members("g", unique)
    transport.publish(unique, [OutgoingMessage(b"x" * 20_000, message_id=f"m{n}") for n in range(450)])
    assert sorted(m.id for m in receive(g, 450)) == sorted(f"m{n}" for n in range(450))
