"""Declaring what `amqp://` needs in RabbitMQ, once per connection, and deleting it again.

Declarations are idempotent in RabbitMQ; a name already declared through a
connection is not declared again through it. A queue that exists with other
arguments (a classic queue of the same name, say) is refused by RabbitMQ
with ``PRECONDITION_FAILED`` naming the argument and both values (a quorum
queue made with another ``x-quorum-initial-group-size`` than ``[transport]
replicas``, say), which reaches the caller as a `TransportError`: RabbitMQ
cannot change a queue's arguments, an operator changes its members with
``rabbitmq-queues grow`` / ``shrink``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import TypeVar

from pika.adapters.blocking_connection import BlockingChannel

from backends.transport.amqp_client import Connection, RefusedError
from backends.transport.amqp_layout import BUCKETS_MS, Layout

NOT_FOUND = 404
T = TypeVar("T")


class Topology:
    """The exchanges and queues one connection has declared."""

    def __init__(self, connection: Connection, layout: Layout, single_active_consumer: bool = False) -> None:
        self.connection = connection
        self.layout = layout
        self.single_active_consumer = single_active_consumer
        self._declared: set[str] = set()
        self._channel: BlockingChannel | None = None

    def topic(self, topic: str) -> str:
        """The topic's fanout exchange."""
        exchange = self.layout.exchange(topic)
        if exchange not in self._declared:
            self.connection.call(
                lambda: self._admin().exchange_declare(exchange, "fanout", durable=True), f"declare {exchange!r}"
            )
            self._declared.add(exchange)
        return exchange

    def group(self, group: str, topic: str) -> str:
        """The group's work queue of ``topic``, bound to the topic's exchange, and its DLQ."""
        queue = self.layout.queue(topic, group)
        if queue in self._declared:
            return queue
        exchange = self.topic(topic)
        dead_letters = self.layout.dead_letter_queue(group)

        def declare() -> None:
            channel = self._admin()
            channel.queue_declare(dead_letters, durable=True, arguments=self.layout.quorum)
            channel.queue_declare(queue, durable=True, arguments=self.layout.queue_arguments(group, self.single_active_consumer))
            channel.queue_bind(queue, exchange)

        self.connection.call(declare, f"declare {queue!r}")
        self._declared.add(queue)
        return queue

    def group_delay(self, group: str, topic: str, bucket_ms: int) -> str:
        """The delay queue of ``bucket_ms`` whose messages go back to the group's work queue."""
        queue = self.layout.group_delay_queue(topic, group, bucket_ms)
        arguments = self.layout.delay_arguments(bucket_ms, "", self.layout.queue(topic, group))
        return self._delay_queue(queue, arguments)

    def publish_delay(self, topic: str, bucket_ms: int) -> str:
        """The delay queue of ``bucket_ms`` whose messages go to the topic's exchange."""
        queue = self.layout.publish_delay_queue(topic, bucket_ms)
        arguments = self.layout.delay_arguments(bucket_ms, self.topic(topic), None)
        return self._delay_queue(queue, arguments)

    def ready(self, queues: Iterable[str]) -> int:
        """Messages ready in ``queues`` (RabbitMQ's count: not those delivered and unacked); absent ones 0."""
        return sum(self._if_present(partial(self._count, queue), f"count {queue!r}", 0) for queue in queues)

    def delay_queues(self, group: str, topic: str) -> list[str]:
        """Every delay queue a message of the group on ``topic`` may wait in."""
        return [self.layout.group_delay_queue(topic, group, b) for b in BUCKETS_MS] + [
            self.layout.publish_delay_queue(topic, b) for b in BUCKETS_MS
        ]

    def delete(self, group: str | None, topic: str) -> None:
        """Delete the queues of ``group`` on ``topic`` (or of the topic itself), those that exist."""
        if group is None:
            names = [self.layout.publish_delay_queue(topic, b) for b in BUCKETS_MS]
        else:
            names = [self.layout.queue(topic, group), self.layout.dead_letter_queue(group)]
            names += [self.layout.group_delay_queue(topic, group, b) for b in BUCKETS_MS]
        for name in names:
            self._if_present(partial(self._delete_queue, name), f"delete {name!r}", None)
        if group is None:
            exchange = self.layout.exchange(topic)
            self._if_present(partial(self._delete_exchange, exchange), f"delete {exchange!r}", None)
        self._declared.clear()

    def forget(self) -> None:
        """Declare everything again when next used (a queue was deleted under this connection)."""
        self._declared.clear()

    def _delay_queue(self, queue: str, arguments: dict[str, object]) -> str:
        if queue not in self._declared:
            self.connection.call(
                lambda: self._admin().queue_declare(queue, durable=True, arguments=arguments), f"declare {queue!r}"
            )
            self._declared.add(queue)
        return queue

    def _if_present(self, make: Callable[[], T], doing: str, absent: T) -> T:
        """``make()``, or ``absent`` when RabbitMQ answers 404 (it closes the channel with it)."""
        try:
            return self.connection.call(make, doing)
        except RefusedError as exc:
            if exc.code != NOT_FOUND:
                raise
            self._channel = None
            return absent

    def _count(self, queue: str) -> int:
        return int(self._admin().queue_declare(queue, passive=True).method.message_count)

    def _delete_queue(self, queue: str) -> None:
        self._admin().queue_delete(queue)

    def _delete_exchange(self, exchange: str) -> None:
        self._admin().exchange_delete(exchange)

    def _admin(self) -> BlockingChannel:
        """A channel for declarations and counts (RabbitMQ closes it on a 404; a new one then)."""
        if self._channel is None or not self._channel.is_open:
            self._channel = self.connection.channel("open a channel")
        return self._channel
