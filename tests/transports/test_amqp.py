"""`amqp://` against the real RabbitMQ: what its layout adds to the contract suite.

Quorum queues and their ``x-delivery-count``, delays served by TTL queues
without a plugin, the DLQ read back with pika itself, refused publishes,
and clear errors for bad URLs and options.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pika
import pytest

from backends.errors import BackendUnavailableError, ConfigurationError, TransportError
from backends.refusal import FirstContact
from backends.transport import open_transport
from backends.transport.amqp_client import Publish
from backends.transport.amqp_layout import BUCKETS_MS, Layout, bucket_for
from backends.transport.amqp_publisher import Publisher
from backends.transport.amqp_transport import AmqpTransport
from backends.transport.base import SubscribeOptions
from backends.types import Failure, OutgoingMessage
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until

WAIT = 20.0


@pytest.fixture
def transport(amqp_url: str, unique: str) -> Iterator[AmqpTransport]:
    opened = AmqpTransport(amqp_url, namespace=unique)
    yield opened
    opened.purge()
    opened.close()


def read_dead_letters(amqp_url: str, namespace: str, group: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every message in ``group``'s dead-letter queue, read (and left there) with pika directly."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        found = []
        while True:
            method, properties, body = channel.basic_get(Layout(namespace).dead_letter_queue(group))
            if method is None:
                return found
            found.append((body, {k: v.decode() if isinstance(v, bytes) else str(v)
                                 for k, v in (properties.headers or {}).items()}))
    finally:
        connection.close()  # unacked: back in the queue


def take(member, count: int, ack: bool = True):
    received = []
    deadline = time.monotonic() + WAIT
    while len(received) < count and time.monotonic() < deadline:
        messages = member.fetch(count - len(received), 0.2)
        if ack and messages:
            member.ack(messages)
        received += messages
    return received


def test_a_member_that_leaves_holding_a_message_counts_the_return(transport: AmqpTransport, unique: str) -> None:
    first = transport.subscribe("g", [unique])
    transport.publish(unique, [OutgoingMessage(b"{}", message_id="m")])
    (held,) = take(first, 1, ack=False)
    first.close()  # RabbitMQ returns it: x-delivery-count 1
    second = transport.subscribe("g", [unique])
    (again,) = take(second, 1, ack=False)
    second.nack(again, 0)  # a copy counting this delivery, straight back to the work queue
    (third,) = take(second, 1)
    assert (held.attempt, again.attempt, third.attempt) == (1, 2, 3)
    assert third.id == held.id == "m"
    second.close()


def test_a_delay_longer_than_a_bucket_is_served_by_several_and_never_early(
    transport: AmqpTransport, amqp_url: str, unique: str
) -> None:
    assert [bucket_for(d) for d in (0, 0.01, 0.15, 0.7, 7.0, 10_000)] == [None, None, 100, 500, 5_000, BUCKETS_MS[-1]]
    member = transport.subscribe("g", [unique])
    transport.publish(unique, [OutgoingMessage(b"{}", message_id="m")])
    (message,) = take(member, 1, ack=False)
    nacked_at = time.monotonic()
    member.nack(message, 1.7)  # 1 s, then 0.5 s, then 0.2 s
    (again,) = take(member, 1)
    assert time.monotonic() - nacked_at >= 1.6
    assert again.attempt == 2  # the hops between delay queues are not deliveries
    assert member.pending() == 0
    member.close()


def test_dead_letters_keep_the_failure_in_the_group_s_quorum_dlq(
    transport: AmqpTransport, amqp_url: str, unique: str
) -> None:
    member = transport.subscribe("billing", [unique])
    transport.publish(unique, [OutgoingMessage(b'{"n": 1}', key="k", headers={"h": "v"}, message_id="p")])
    (message,) = take(member, 1, ack=False)
    member.dead_letter(message, Failure("ValueError", "bad", "Traceback ...", 3, 1.0, 2.0))
    assert member.pending() == 0
    ((payload, headers),) = read_dead_letters(amqp_url, unique, "billing")
    assert payload == b'{"n": 1}'
    assert (headers["x-reliable-error-type"], headers["x-reliable-error-message"], headers["h"]) == (
        "ValueError", "bad", "v")
    member.close()


def test_a_publish_no_queue_takes_is_refused_not_dropped(transport: AmqpTransport, unique: str) -> None:
    with pytest.raises(TransportError, match="had no queue to take the message"):
        transport.publish(unique, [OutgoingMessage(b"{}")])
    transport.declare("late", [unique])  # the group's queue exists from now on
    transport.publish(unique, [OutgoingMessage(b"{}", message_id="kept")])
    member = transport.subscribe("late", [unique])
    assert [m.id for m in take(member, 1)] == ["kept"]
    with pytest.raises(TransportError, match="had no queue"):
        transport.publish_to_group("nobody", unique, [OutgoingMessage(b"{}")])
    member.close()


def test_a_queue_declared_otherwise_is_refused_with_rabbitmq_s_reason(amqp_url: str, unique: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    layout = Layout(unique)
    connection.channel().queue_declare(layout.queue(unique, "g"), durable=True)  # a classic queue
    try:
        with AmqpTransport(amqp_url, namespace=unique) as transport:
            with pytest.raises(TransportError, match="PRECONDITION_FAILED"):
                transport.subscribe("g", [unique])
    finally:  # and what the refused subscribe declared before the queue
        channel = connection.channel()
        for queue in (layout.queue(unique, "g"), layout.dead_letter_queue("g")):
            channel.queue_delete(queue)
        channel.exchange_delete(layout.exchange(unique))
        connection.close()


@pytest.mark.parametrize(
    ("url", "options", "error"),
    [
        ("amqp://", {}, "expected amqp://user:password@host:port/vhost"),
        ("amqp://guest:guest@127.0.0.1:5672/", {"namespace": "amq.x"}, "namespace='amq.x'"),
        ("amqp://guest:guest@127.0.0.1:5672/", {"visibility_timeout": 0}, "visibility_timeout=0"),
        ("amqp://guest:guest@127.0.0.1:5672/", {"single_active_consumer": "perhaps"}, "single_active_consumer"),
        ("amqp://guest:guest@127.0.0.1:5672/", {"prefetch": 3}, "unknown option"),
    ],
)
def test_bad_urls_and_options_are_named(url: str, options: dict, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        open_transport(url, **options)


def test_names_that_would_make_two_queues_one_are_refused(transport: AmqpTransport) -> None:
    with pytest.raises(TransportError, match="amqp:// allows"):
        transport.subscribe("a:b", ["t"])


def test_an_unreachable_server_is_unavailable_not_refused(unique: str) -> None:
    from backends.errors import BackendUnavailableError

    with AmqpTransport("amqp://guest:guest@127.0.0.1:1/", namespace=unique, connect_timeout=2) as transport:
        with pytest.raises(BackendUnavailableError, match="amqp: connect"):
            transport.publish(unique, [OutgoingMessage(b"{}")])


def test_single_active_consumer_keeps_one_member_consuming(transport: AmqpTransport, amqp_url: str, unique: str) -> None:
    ordered = AmqpTransport(amqp_url, namespace=unique, single_active_consumer=True)
    try:
        first, second = ordered.subscribe("g", [unique]), ordered.subscribe("g", [unique])
        ordered.publish(unique, [OutgoingMessage(b"{}", message_id=f"m{n}") for n in range(20)])
        got = [m.id for m in take(first, 20)]
        assert got == [f"m{n}" for n in range(20)]  # all to the active member, in order
        assert second.fetch(1, 0.3) == []
        first.close()
        ordered.publish(unique, [OutgoingMessage(b"{}", message_id="after")])
        assert [m.id for m in take(second, 1)] == ["after"]  # the stand-by took over
        second.close()
    finally:
        ordered.purge()
        ordered.close()


def test_a_member_busy_longer_than_its_heartbeat_keeps_its_messages(amqp_url: str, unique: str) -> None:
    # a handler that makes no call for three heartbeat periods: the keep-alive thread answers for it
    with AmqpTransport(amqp_url, namespace=unique, visibility_timeout=2) as transport:
        busy = transport.subscribe("g", [unique])
        transport.publish(unique, [OutgoingMessage(b"{}", message_id="slow")])
        held = take(busy, 1, ack=False)
        other = transport.subscribe("g", [unique])
        time.sleep(6)  # the work itself, not synchronisation: no call on the connection meanwhile
        assert other.fetch(1, 0.5) == []  # the busy member's connection lived: nothing came back
        busy.ack(held)
        assert busy.pending() == 0
        busy.close()
        other.close()
        transport.purge()


def queue_length(amqp_url: str, queue: str) -> int:
    """Messages ready in ``queue``, as RabbitMQ counts them (through a connection of its own)."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def test_a_batch_rabbitmq_nacks_in_part_raises_and_its_acked_messages_are_kept(amqp_url: str, unique: str) -> None:
    """A full queue (``reject-publish``) nacks the rest of a batch: the publish raises, so the caller
    publishes again, and what RabbitMQ acked is in the queue. (A classic queue: a quorum queue applies
    its length limit late, it took all 50.)"""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.queue_declare(unique, durable=True, arguments={"x-max-length": 10, "x-overflow": "reject-publish"})
    publisher = Publisher([pika.URLParameters(amqp_url)], "test", FirstContact("[transport] url", amqp_url))
    try:
        with pytest.raises(BackendUnavailableError, match=r"refused 40 message\(s\) \(negative confirm\)"):
            publisher.publish([Publish("", unique, b"m", pika.BasicProperties())] * 50, "publish to a full queue")
        assert not publisher.open  # the next batch goes through a new connection (the cluster test shows why)
        assert queue_length(amqp_url, unique) == 10
    finally:
        publisher.close()
        channel.queue_delete(unique)
        connection.close()


def test_a_batch_cut_mid_flight_raises_and_every_publish_that_returned_is_kept(amqp_url: str, unique: str) -> None:
    """The connection cut while a batch's confirms are in flight: that publish raises though part of the
    batch reached the queue; published again, every message of every publish that returned is read back."""
    target = urlsplit(amqp_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5672)
    proxied = urlunsplit((target.scheme, f"{target.username}:{target.password}@127.0.0.1:{proxy.port}",
                          target.path, "", ""))
    transport = AmqpTransport(proxied, namespace=unique)
    queue = Layout(unique).queue(unique, unique)
    first = [OutgoingMessage(b"a", message_id=f"a{n}") for n in range(500)]
    batch = [OutgoingMessage(b"b", message_id=f"b{n}") for n in range(20_000)]
    outcome: list[Exception | None] = []

    def publish_batch() -> None:
        try:
            transport.publish(unique, batch)
            outcome.append(None)
        except BackendUnavailableError as exc:
            outcome.append(exc)

    try:
        transport.declare(unique, [unique])
        transport.publish(unique, first)
        publishing = threading.Thread(target=publish_batch)
        publishing.start()
        wait_until(lambda: queue_length(amqp_url, queue) > len(first), "the batch reaching the queue")
        proxy.cut()
        publishing.join()
        assert isinstance(outcome[0], BackendUnavailableError)
        assert queue_length(amqp_url, queue) < len(first) + len(batch)  # the cut really was mid-batch
        proxy.restore()
        transport.publish(unique, batch)  # what the caller does with BackendUnavailableError
        received: set[str] = set()
        subscription = transport.subscribe(unique, [unique], SubscribeOptions(prefetch=1000))

        def receive() -> bool:
            messages = subscription.fetch(1000, 1.0)
            received.update(m.id for m in messages)
            subscription.ack(messages)
            return received >= {m.message_id for m in first + batch}

        wait_until(receive, "every message of the publishes that returned", timeout=60)
        subscription.close()
    finally:
        proxy.restore()
        transport.purge()
        transport.close()
        proxy.close()
