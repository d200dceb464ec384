"""`nats://` against the real NATS JetStream server: what the contract suite does not cover.

Every test uses a namespace of its own, whose streams are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import nats
import pytest

from backends.errors import BackendUnavailableError, ConfigurationError, TransportError
from backends.transport import open_transport
from backends.transport.base import SubscribeOptions
from backends.transport.kafka_layout import failure_of
from backends.transport.nats_layout import Layout
from backends.transport.nats_transport import NatsTransport
from backends.types import Failure, Message, OutgoingMessage

WAIT = 20.0


@pytest.fixture
def transport(nats_url: str, unique: str) -> Iterator[NatsTransport]:
    opened = open_transport(f"{nats_url}?namespace={unique}", visibility_timeout=30)
    assert isinstance(opened, NatsTransport)
    yield opened
    opened.purge()
    opened.close()


def receive(subscription, count: int, ack: bool = True) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + WAIT
    while len(got) < count and time.monotonic() < deadline:
        messages = subscription.fetch(count - len(got), 0.2)
        if ack and messages:
            subscription.ack(messages)
        got += messages
    return got


def read_dead_letters(nats_url: str, namespace: str, group: str, count: int) -> list[tuple[bytes, dict[str, str]]]:
    """The first ``count`` records of ``group``'s dead-letter stream, read with nats-py directly."""
    layout = Layout(namespace)

    async def read() -> list[tuple[bytes, dict[str, str]]]:
        client = await nats.connect(nats_url)
        try:
            js = client.jetstream()
            return [
                (m.data, dict(m.headers or {}))
                for m in [await js.get_msg(layout.dead_letter_stream(group), seq) for seq in range(1, count + 1)]
            ]
        finally:
            await client.close()

    return asyncio.run(read())


def failure() -> Failure:
    return Failure("ValueError", "bad", "Traceback ...", 3, 1.0, 2.0)


def test_dead_letter_lands_in_the_group_s_dead_letter_stream_with_the_failure(
    transport: NatsTransport, nats_url: str, unique: str
) -> None:
    member = transport.subscribe("billing", [unique])
    transport.publish(unique, [OutgoingMessage(b"bad", key="k", headers={"h": "v"}, message_id="p1")])
    (message,) = receive(member, 1, ack=False)
    member.dead_letter(message, failure())
    ((payload, headers),) = read_dead_letters(nats_url, unique, "billing", 1)
    assert payload == b"bad" and headers["h"] == "v" and headers["x-reliable-id"] == "p1"
    assert failure_of(headers) == failure()
    assert member.pending() == 0  # terminated: JetStream will not deliver it again
    member.close()


def test_jetstream_drops_a_republished_message_id_within_its_window(transport: NatsTransport, unique: str) -> None:
    member = transport.subscribe("g", [unique])
    transport.publish(unique, [OutgoingMessage(b"1", message_id="same")])
    transport.publish(unique, [OutgoingMessage(b"2", message_id="same"), OutgoingMessage(b"3", message_id="other")])
    got = receive(member, 2) + member.fetch(1, 1.0)
    assert sorted(m.payload for m in got) == [b"1", b"3"]
    member.close()


def test_in_progress_keeps_a_message_past_its_ack_wait(transport: NatsTransport, unique: str) -> None:
    holder = transport.subscribe("g", [unique], SubscribeOptions(lease=1.0))
    other = transport.subscribe("g", [unique], SubscribeOptions(lease=1.0))
    transport.publish(unique, [OutgoingMessage(b"long", message_id="long")])
    (held,) = receive(holder, 1, ack=False)
    stolen: list[Message] = []
    deadline = time.monotonic() + 3.0  # three AckWaits, each restarted by +WPI
    while time.monotonic() < deadline:
        holder.in_progress([held])
        stolen += other.fetch(1, 0.3)
    assert stolen == []
    holder.ack([held])
    assert holder.pending() == 0
    holder.close(), other.close()


def test_an_expired_ack_wait_redelivers_counted(transport: NatsTransport, unique: str) -> None:
    member = transport.subscribe("g", [unique], SubscribeOptions(lease=1.0))
    transport.publish(unique, [OutgoingMessage(b"x", message_id="x")])
    (first,) = receive(member, 1, ack=False)
    (again,) = receive(member, 1)  # not acked within AckWait: JetStream delivers it again
    assert (first.attempt, again.attempt, again.id) == (1, 2, "x")
    member.close()


def test_bad_urls_options_and_names_are_named(nats_url: str, transport: NatsTransport) -> None:
    with pytest.raises(ConfigurationError, match="expected nats://"):
        open_transport("nats://")
    with pytest.raises(ConfigurationError, match="not host:port"):
        open_transport("nats://localhost")
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        open_transport(nats_url, visibility_timeout=0)
    with pytest.raises(ConfigurationError, match="namespace"):
        open_transport(f"{nats_url}?namespace=a.b")
    with pytest.raises(ConfigurationError, match="replicas"):
        open_transport(f"{nats_url}?replicas=9")
    with pytest.raises(TransportError, match="topic name 'a.b'"):
        transport.publish("a.b", [OutgoingMessage(b"x")])
    with pytest.raises(TransportError, match="group name 'g>'"):
        transport.subscribe("g>", ["t"])


def test_a_server_that_is_gone_is_unavailable() -> None:
    with pytest.raises(BackendUnavailableError):
        open_transport("nats://127.0.0.1:1", request_timeout=2)
