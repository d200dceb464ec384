"""`amqp://user:password@host:port/vhost`: RabbitMQ through pika, on quorum queues.

Each topic is a fanout exchange; each group has a durable quorum queue per
topic bound to it, which its members share (`amqp_layout`). RabbitMQ keeps
a message for the groups whose queues exist when it is published: a group
is declared when a member subscribes, or beforehand with `declare` (the
`App` declares the groups of its own handlers before it publishes). A
publish that no queue takes is refused with a `TransportError` rather than
dropped.

* ``attempt`` counts deliveries: quorum queues' ``x-delivery-count`` (a member
  died or left holding the message) plus the deliveries of earlier copies;
* ``nack(delay)`` publishes a copy to the group's delay queue for that delay
  (quorum, TTL, dead-lettered at-least-once back to the work queue), then
  acks the original: no delayed-message plugin;
* ``dead_letter`` publishes a copy with its failure to ``%DLQ%``'s place,
  ``<namespace>:dlq:<group>``, then acks; the work queues also dead-letter
  there at-least-once what RabbitMQ itself rejects;
* a member that dies or leaves hands its unacked messages back at once (its
  connection closes); one that hangs loses them when its heartbeat times out
  (``visibility_timeout``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pika
import structlog

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import ConfigurationError
from backends.refusal import FirstContact
from backends.transport.amqp_client import (
    Connection,
    Publish,
    RefusedError,
    UnroutableError,
    alternatives,
    parameters,
)
from backends.transport.amqp_layout import (
    CAPABILITIES,
    DUE_HEADER,
    KEY_HEADER,
    PUBLISHED_HEADER,
    Layout,
    bucket_for,
    check_amqp_name,
)
from backends.transport.amqp_publisher import Publisher
from backends.transport.amqp_subscription import AmqpSubscription
from backends.transport.amqp_topology import NOT_FOUND, Topology
from backends.transport.base import SubscribeOptions, Transport, count, seconds, server_list
from backends.types import OutgoingMessage
from backends.urls import redact

log = structlog.get_logger(__name__)
PERSISTENT = 2


class AmqpTransport(Transport):
    """A `Transport` over RabbitMQ quorum queues.

    Options: ``namespace`` (prefix of every exchange and queue, default
    ``reliable``), ``visibility_timeout`` (the AMQP heartbeat: a member that
    stops answering loses its messages after about this many seconds,
    default 30), ``connect_timeout`` (seconds, default 10),
    ``single_active_consumer`` (``true``: one member of a group consumes a
    queue at a time, the others stand by: order across members kept),
    ``replicas`` (members of each quorum queue it declares: its initial group
    size; an existing queue of another size is refused by RabbitMQ, naming
    both), ``servers`` (more ``host:port`` nodes of the cluster, tried in
    order when the URL's cannot be reached; same credentials and vhost).
    """

    capabilities = CAPABILITIES

    def __init__(
        self,
        url: str,
        clock: Clock = SYSTEM_CLOCK,
        *,
        namespace: str = "reliable",
        visibility_timeout: float | str = 30.0,
        connect_timeout: float | str = 10.0,
        single_active_consumer: bool | str = False,
        replicas: int | str | None = None,
        servers: Sequence[str] | str = (),
    ) -> None:
        first = parameters(
            url, seconds("visibility_timeout", visibility_timeout), seconds("connect_timeout", connect_timeout)
        )
        self._parameters = alternatives(first, server_list(servers))
        self._contact = FirstContact("[transport] url", redact(url))
        self._layout = Layout(namespace, None if replicas is None else count("replicas", replicas))
        self._single_active = _flag("single_active_consumer", single_active_consumer)
        self._clock = clock
        self._lock = threading.Lock()
        self._topology: Topology | None = None
        self._publisher: Publisher | None = None
        self._subscriptions: list[AmqpSubscription] = []
        self._groups: set[tuple[str, str]] = set()

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        def batch() -> list[Publish]:
            topology = self._open()
            exchange = topology.topic(topic)
            now = self._clock.time()
            found = []
            for message in messages:
                bucket = bucket_for(message.delay)
                if bucket is None:
                    found.append(Publish(exchange, "", message.payload, self._properties(message, now, {})))
                else:
                    due = {DUE_HEADER: repr(now + message.delay)}
                    found.append(Publish("", topology.publish_delay(topic, bucket), message.payload,
                                         self._properties(message, now, due)))
            return found

        groups = sorted(group for group, of in self._groups if of == topic)
        self._publish(batch, f"publish to {topic!r}", topic, groups, timeout)

    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        """Straight into the group's work queue (a replay)."""
        def batch() -> list[Publish]:
            queue = self._layout.queue(topic, group)
            now = self._clock.time()
            return [Publish("", queue, m.payload, self._properties(m, now, {})) for m in messages]

        self._publish(batch, f"publish to group {group!r}", topic, [group] if (group, topic) in self._groups else [])

    def _publish(self, batch: Callable[[], list[Publish]], doing: str, topic: str, groups: list[str],
                 timeout: float | None = None) -> None:
        """Publish ``batch()`` (its confirms waited for ``timeout`` seconds at most, where given).
        RabbitMQ finding no exchange (404) or no queue (the message returned) means what this
        transport declared was deleted under it: declared again, published again."""
        with self._lock:
            try:
                self._publishing().publish(batch(), doing, timeout)
                return
            except (RefusedError, UnroutableError) as exc:
                if isinstance(exc, RefusedError) and exc.code != NOT_FOUND:
                    raise
                topology = self._open()
                topology.forget()
                topology.topic(topic)
                for group in groups:
                    topology.group(group, topic)
                log.warning("transport.declared_again", topic=topic, groups=groups, error=str(exc))
            self._publishing().publish(batch(), doing, timeout)

    def declare(self, group: str, topics: Sequence[str]) -> None:
        """Make RabbitMQ keep what is published to ``topics`` from now on for ``group``."""
        self._check_names(group=group)
        for topic in topics:
            self._check_names(topic=topic)
        with self._lock:
            topology = self._open()
            for topic in topics:
                topology.group(group, topic)
                self._groups.add((group, topic))

    def subscribe(
        self, group: str, topics: Sequence[str], options: SubscribeOptions | None = None
    ) -> AmqpSubscription:
        self._check_open()
        subscription = AmqpSubscription(
            group, topics, options or SubscribeOptions(), parameters=self._parameters, layout=self._layout,
            clock=self._clock, single_active_consumer=self._single_active, contact=self._contact,
        )
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if not s.closed] + [subscription]
            self._groups.update((group, topic) for topic in subscription.topics)
        return subscription

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for subscription in self._subscriptions:
                subscription.close()
            if self._topology is not None:
                self._topology.connection.close()
            if self._publisher is not None:
                self._publisher.close()

    def purge(self) -> None:
        """Delete the queues and exchanges of the groups and topics this transport has seen (tests)."""
        with self._lock:
            topology = self._open()
            for group, topic in sorted(self._groups):
                topology.delete(group, topic)
            for topic in sorted({topic for _, topic in self._groups}):
                topology.delete(None, topic)
            self._groups.clear()

    def _open(self) -> Topology:
        """The connection that declares what publishes need (a new one after a failure)."""
        self._check_open()
        if self._topology is None or not self._topology.connection.open:
            self._topology = Topology(Connection(self._parameters, "topology", self._contact), self._layout, self._single_active)
        return self._topology

    def _publishing(self) -> Publisher:
        """The connection publishes go through, a window of confirms in flight (a new one after a failure)."""
        self._check_open()
        if self._publisher is None or not self._publisher.open:
            self._publisher = Publisher(self._parameters, "publisher", self._contact)
        return self._publisher

    def _check_name(self, kind: str, name: str) -> None:
        check_amqp_name(kind, name)

    @staticmethod
    def _properties(message: OutgoingMessage, now: float, extra: dict[str, str]) -> pika.BasicProperties:
        headers = {**message.headers, **extra, PUBLISHED_HEADER: repr(now)}
        if message.key is not None:
            headers[KEY_HEADER] = message.key
        return pika.BasicProperties(
            delivery_mode=PERSISTENT, message_id=message.message_id,
            timestamp=int(now), headers=headers,
        )


def _flag(name: str, value: bool | str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigurationError(f"transport option {name}={value!r}: true or false is required")

