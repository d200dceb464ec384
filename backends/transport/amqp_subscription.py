"""One member of a group on `amqp://`: a consumer per topic queue, manual acks, a prefetch.

The member has a connection of its own. RabbitMQ pushes up to ``prefetch``
unacked messages to it (``basic.qos``); they wait in a buffer until fetched.
A message's ``receipt`` is its delivery tag on the member's channel. Closing
the member (or its death) returns every unacked message to the queue, where
RabbitMQ counts the return in ``x-delivery-count``.

``nack`` and ``dead_letter`` publish a copy (to a delay queue, to the DLQ),
and ack the original only once RabbitMQ confirmed the copy: a crash
between the two leaves both, and the framework's token check drops the
duplicate. A delayed message that comes back before it is due (a delay is
served by a sum of bucket TTLs) is sent on the same way, never handed out.

The copies go through a connection of their own (`Publisher`), so that the
member's connection never publishes: during a memory or disk alarm RabbitMQ
blocks a connection that publishes, and pika would close the member's,
returning every message it holds counted as delivered once more (a long
alarm spent a retrying message's redeliveries). A copy the alarm refuses
stays owed (`WritesRefusedError`: the worker keeps its place): the member
holds its original, uncounted, and sends the copy before it hands out
anything else, once RabbitMQ takes publishes again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pika
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from backends.clock import Clock
from backends.errors import BackendUnavailableError, TransportError
from backends.refusal import FirstContact
from backends.transport.amqp_client import Connection, Publish, UnroutableError
from backends.transport.amqp_layout import (
    CAPABILITIES,
    DELIVERED_HEADER,
    DELIVERY_COUNT_HEADER,
    DUE_HEADER,
    Layout,
    bucket_for,
    check_amqp_name,
    delivered_before,
    text_headers,
    to_message,
)
from backends.transport.amqp_publisher import Publisher
from backends.transport.amqp_topology import Topology
from backends.transport.base import SubscribeOptions, Subscription
from backends.transport.kafka_layout import failure_headers
from backends.types import Failure, Message

log = structlog.get_logger(__name__)

SLICE = 0.05
"""Seconds a waiting fetch holds the connection at a time (keep-alive and acks get their turn)."""


@dataclass(frozen=True)
class Delivery:
    """A message as RabbitMQ delivered it, kept until it is settled."""

    topic: str
    tag: int
    properties: pika.BasicProperties
    body: bytes
    headers: dict[str, str]


@dataclass(frozen=True)
class Owed:
    """A copy RabbitMQ must confirm before the original it stands for is acked."""

    delivery: Delivery
    copy: Publish
    doing: str
    declare: Callable[[], str]
    """Declares the copy's queue again, should it have been deleted (RabbitMQ returned the copy)."""


class AmqpSubscription(Subscription):
    """A member of a group on RabbitMQ (see `backends.transport.amqp_transport`)."""

    def __init__(
        self,
        group: str,
        topics: Sequence[str],
        options: SubscribeOptions,
        *,
        parameters: Sequence[pika.URLParameters],
        layout: Layout,
        clock: Clock,
        single_active_consumer: bool = False,
        contact: FirstContact,
    ) -> None:
        super().__init__(group, topics, options)
        check_amqp_name("group", group)
        for topic in self.topics:
            check_amqp_name("topic", topic)
        self.capabilities = CAPABILITIES
        self._layout = layout
        self._clock = clock
        self._buffer: deque[Delivery] = deque()
        self._unsettled: dict[int, Delivery] = {}
        self._queues: dict[str, str] = {}  # consumer tag: its queue
        self._cancelled: list[str] = []  # queues whose consumer RabbitMQ cancelled
        self._owed: deque[Owed] = deque()  # oldest first
        self._parameters, self._contact = parameters, contact
        self._publisher: Publisher | None = None  # the copies' connection, opened on first use
        self.closed = False
        connection = Connection(parameters, f"member of {group!r}", contact)
        try:
            self._topology = Topology(connection, layout, single_active_consumer)
            self._channel = self._consume(connection)
        except BaseException:
            connection.close()
            raise

    def _consume(self, connection: Connection) -> BlockingChannel:
        queues = {topic: self._topology.group(self.group, topic) for topic in self.topics}
        channel = connection.channel("open the consumer channel")

        def start() -> None:
            channel.basic_qos(prefetch_count=self.options.prefetch)
            channel.add_on_cancel_callback(self._on_cancel)
            for topic, queue in queues.items():
                self._queues[channel.basic_consume(queue, self._on_delivery(topic), auto_ack=False)] = queue

        connection.call(start, f"consume as group {self.group!r}")
        return channel

    def _on_delivery(self, topic: str) -> Any:
        def deliver(_channel: Any, method: Any, properties: pika.BasicProperties, body: bytes) -> None:
            delivery = Delivery(topic, method.delivery_tag, properties, body, text_headers(properties.headers))
            self._unsettled[delivery.tag] = delivery
            self._buffer.append(delivery)

        return deliver

    def _on_cancel(self, frame: Any) -> None:
        """RabbitMQ cancelled a consumer (its queue was deleted): `_check_consuming` raises."""
        self._cancelled.append(self._queues.get(frame.method.consumer_tag, frame.method.consumer_tag))

    def _check_consuming(self) -> None:
        """An outage once RabbitMQ cancelled a consumer: the member leaves, and joining again
        declares the queue anew (else it would wait for ever on a queue that is gone)."""
        if self._cancelled:
            raise BackendUnavailableError(
                f"amqp: RabbitMQ cancelled the consumer of group {self.group!r} on queue "
                f"{self._cancelled[0]!r}: the queue was deleted (what it held is gone with it); "
                "the group joins again and declares it anew")

    # -- the contract -------------------------------------------------------------------------

    def fetch(self, max_messages: int, timeout: float) -> list[Message]:
        self._check_open()
        self._check_fetch(max_messages)
        deadline = time.monotonic() + timeout
        connection = self._topology.connection
        while True:
            connection.wait(0, f"fetch for group {self.group!r}")
            self._check_consuming()
            self._pay()
            messages = self._take(max_messages)
            remaining = deadline - time.monotonic()
            if messages or remaining <= 0:
                return messages
            connection.wait(min(SLICE, remaining), f"fetch for group {self.group!r}")

    def ack(self, messages: Sequence[Message]) -> None:
        self._check_open()
        if not messages:
            return
        tags = {self._delivery(m).tag for m in messages}
        top = max(tags)

        def ack() -> None:
            if all(tag in tags for tag in self._unsettled if tag <= top):
                self._channel.basic_ack(top, multiple=True)  # every earlier delivery too: one frame
            else:
                for tag in sorted(tags):
                    self._channel.basic_ack(tag)
            for tag in tags:
                del self._unsettled[tag]

        self._topology.connection.call(ack, f"ack for group {self.group!r}")

    def nack(self, message: Message, delay: float) -> None:
        """A copy counting this delivery waits ``delay`` seconds in a delay queue; the original is acked."""
        self._check_open()
        delivery = self._delivery(message)
        due = self._clock.time() + delay
        self._send_on(delivery, due, delivered=delivered_before(delivery.headers) + 1)
        self._pay()

    def dead_letter(self, message: Message, failure: Failure) -> None:
        """A copy with its failure goes to the group's DLQ; the original is acked."""
        self._check_open()
        delivery = self._delivery(message)
        headers = {**delivery.headers, **failure_headers(failure, message)}
        headers.pop(DELIVERY_COUNT_HEADER, None)
        headers[DELIVERED_HEADER] = str(message.attempt)
        copy = Publish("", self._layout.dead_letter_queue(self.group), delivery.body,
                       _with_headers(delivery.properties, headers))
        self._owed.append(Owed(delivery, copy, f"dead-letter for group {self.group!r}",
                               lambda: self._topology.group(self.group, delivery.topic)))
        self._pay()

    def pending(self) -> int:
        """Ready in the group's queues and delay queues, plus what this member holds.

        AMQP 0-9-1 does not tell how many messages other members hold unacked.
        The queues are counted first; a delivery that left them before the count
        may still wait in pika's buffer, so pika hands those over before what
        this member holds is counted (else one message counts nowhere).
        """
        self._check_open()
        queues = []
        for topic in self.topics:
            queues.append(self._layout.queue(topic, self.group))
            queues += self._topology.delay_queues(self.group, topic)
        ready = self._topology.ready(queues)
        self._topology.connection.wait(0, f"count for group {self.group!r}")
        return ready + len(self._unsettled)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._topology.connection.close()  # RabbitMQ returns every unacked message to its queue
        if self._publisher is not None:
            self._publisher.close()

    # -- helpers ------------------------------------------------------------------------------

    def _take(self, max_messages: int) -> list[Message]:
        """Up to ``max_messages`` due messages from the buffer; early ones are owed on (`_pay`)."""
        messages: list[Message] = []
        now = self._clock.time()
        while self._buffer and len(messages) < max_messages:
            delivery = self._buffer.popleft()
            due = float(delivery.headers.get(DUE_HEADER, 0) or 0)
            if bucket_for(due - now) is not None:
                self._send_on(delivery, due, delivered=delivered_before(delivery.headers))
                continue
            messages.append(to_message(delivery.topic, delivery.properties.message_id, delivery.body,
                                       delivery.headers, str(delivery.tag), now))
        return messages

    def _send_on(self, delivery: Delivery, due: float, *, delivered: int) -> None:
        """Owe a copy due at ``due`` to the delay queue that serves it next (or the work queue)."""
        headers = {**delivery.headers, DELIVERED_HEADER: str(delivered)}
        headers.pop(DELIVERY_COUNT_HEADER, None)
        bucket = bucket_for(due - self._clock.time())
        declare: Callable[[], str]
        if bucket is None:
            headers.pop(DUE_HEADER, None)
            queue = self._layout.queue(delivery.topic, self.group)
            declare = partial(self._topology.group, self.group, delivery.topic)
        else:
            headers[DUE_HEADER] = repr(due)
            declare = partial(self._topology.group_delay, self.group, delivery.topic, bucket)
            queue = declare()
        copy = Publish("", queue, delivery.body, _with_headers(delivery.properties, headers))
        self._owed.append(Owed(delivery, copy, f"redeliver for group {self.group!r}", declare))

    def _pay(self) -> None:
        """Send the copies owed, oldest first, acking each original once RabbitMQ confirmed its
        copy. One that an alarm refuses raises `WritesRefusedError` and stays owed with the rest.
        One refused for good (a `TransportError`: headers above ``frame_max`` with those the copy
        adds) is owed no more, its original held until the member leaves: it raises for the call
        that owed it, and is logged for a later one. It stayed owed, so every later nack and
        dead letter of the member raised its error."""
        own = self._owed[-1] if self._owed else None
        while self._owed:
            owed = self._owed[0]
            try:
                self._send(owed)
            except TransportError as exc:
                self._owed.popleft()
                if owed is own:
                    raise
                log.error("transport.copy_refused", group=self.group, doing=owed.doing, error=str(exc))
                continue
            self._owed.popleft()

            def ack(delivery: Delivery = owed.delivery) -> None:
                self._channel.basic_ack(delivery.tag)
                self._unsettled.pop(delivery.tag, None)

            self._topology.connection.call(ack, owed.doing)

    def _send(self, owed: Owed) -> None:
        """Publish the copy, confirmed. A queue deleted under the member (RabbitMQ returns the
        copy) is declared again and the copy sent again."""
        try:
            self._copies().publish([owed.copy], owed.doing)
        except UnroutableError:
            self._topology.forget()
            owed.declare()
            log.warning("transport.queue_declared_again", group=self.group, queue=owed.copy.routing_key,
                        reason="deleted while the group used it")
            self._copies().publish([owed.copy], owed.doing)

    def _copies(self) -> Publisher:
        """The connection the copies go through (a new one after a failure)."""
        if self._publisher is None or not self._publisher.open:
            self._publisher = Publisher(self._parameters, f"copies of group {self.group!r}", self._contact)
        return self._publisher

    def _delivery(self, message: Message) -> Delivery:
        delivery = self._unsettled.get(int(message.receipt or -1))
        if delivery is None:
            raise TransportError(f"message {message.id!r} is not held by this member of group {self.group!r}")
        return delivery

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(f"subscription of group {self.group!r} is closed")


def _with_headers(properties: pika.BasicProperties, headers: dict[str, str]) -> pika.BasicProperties:
    return pika.BasicProperties(
        delivery_mode=2, message_id=properties.message_id, timestamp=properties.timestamp, headers=headers
    )

