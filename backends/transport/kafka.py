"""`kafka://host:port[,host:port]`: Apache Kafka through librdkafka (confluent-kafka).

Partitions are queues and Kafka offsets are offsets; a group is a Kafka
consumer group that never auto-commits: the framework commits the contiguous
prefix of done offsets (``capabilities.consumer_offsets``), or seeks to the
offsets it saved in its own store when partitions are assigned.

Kafka has no per-message acknowledgement, redelivery or delay, so
(following Spring Kafka's retry topics, see `kafka_layout`):

* ``ack`` records nothing on the broker: the worker's watermark turns done
  offsets into ``commit``;
* ``nack(delay)`` produces a copy to the group's retry topic of the delay's
  bucket, with the delivery count and due time in headers; the original is
  then done. Members read their group's retry topics and hold a copy back
  until it is due;
* ``dead_letter`` produces a copy with its failure to ``<topic>-dlt-<group>``;
* a publish with ``delay`` goes to a ``<topic>-delayed-<ms>`` topic every group
  reads and holds back until due; ``publish_to_group`` to the group's retry
  topic of bucket 0.

The delivery count (``attempt``) counts nacks. A message read again because
its member died before committing is not counted: Kafka cannot tell that it
was delivered before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import structlog

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import ConfigurationError
from backends.transport.base import (
    ORIGIN_TOPIC_HEADER,
    SubscribeOptions,
    Transport,
    count,
    seconds,
    with_servers,
)
from backends.transport.kafka_client import Publisher, Record, Servers
from backends.transport.kafka_layout import (
    CAPABILITIES,
    DUE_HEADER,
    ID_HEADER,
    PUBLISHED_HEADER,
    bucket_ms,
    check_header_names,
    check_kafka_name,
    delayed_topic,
    encode_headers,
    retry_topic,
)
from backends.transport.kafka_subscription import KafkaSubscription
from backends.types import OutgoingMessage

log = structlog.get_logger(__name__)

class KafkaTransport(Transport):
    """A `Transport` over a Kafka cluster.

    Options: ``visibility_timeout`` (Kafka leases partitions, not messages: the
    session timeout, seconds without a heartbeat before a member is presumed
    dead and its partitions move, default 30; the cluster bounds it, 6 s to
    30 min by default), ``max_poll_interval`` (seconds a fetched batch may stay in the handler
    before the member is presumed stuck and leaves its group, default 300, Kafka's: its partitions
    move and its later commits are refused), ``request_timeout``
    (seconds a produce, commit or metadata request may take before the cluster
    counts as unreachable, default 30), ``replicas`` (when set, a topic
    with another replication factor is refused when first used), ``servers`` (more ``host:port`` of the
    cluster besides the URL's).
    """

    capabilities = CAPABILITIES
    binary_fields = True

    def __init__(
        self,
        url: str,
        clock: Clock = SYSTEM_CLOCK,
        *,
        visibility_timeout: float | str = 30.0,
        request_timeout: float | str = 30.0,
        max_poll_interval: float | str = 300.0,
        replicas: int | str | None = None,
        servers: Sequence[str] | str = (),
    ) -> None:
        self._servers = Servers.parse(with_servers(url, servers))
        self._clock = clock
        self._session_timeout = seconds("visibility_timeout", visibility_timeout)
        self._request_timeout = seconds("request_timeout", request_timeout)
        self._max_poll_interval = seconds("max_poll_interval", max_poll_interval)
        if self._max_poll_interval < self._session_timeout:
            raise ConfigurationError(
                f"kafka: max_poll_interval {self._max_poll_interval!r} is below visibility_timeout "
                f"{self._session_timeout!r} (Kafka's session timeout); expected at least that"
            )
        wanted = None if replicas is None else count("replicas", replicas)
        self._publisher = Publisher(self._servers, {}, self._request_timeout, wanted)
        self._subscriptions: list[KafkaSubscription] = []

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        check_header_names(messages)
        self._produce(
            [
                (topic, message, {})
                if message.delay <= 0
                else (delayed_topic(topic, bucket_ms(message.delay)), message, {ORIGIN_TOPIC_HEADER: topic})
                for message in messages
            ],
            timeout,
        )

    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        check_header_names(messages)
        self._produce([(retry_topic(topic, group, bucket_ms(message.delay)), message, {}) for message in messages])

    def subscribe(
        self, group: str, topics: Sequence[str], options: SubscribeOptions | None = None
    ) -> KafkaSubscription:
        self._check_open()
        subscription = KafkaSubscription(
            group,
            topics,
            options or SubscribeOptions(),
            servers=self._servers,
            publisher=self._publisher,
            clock=self._clock,
            settings=self._consumer_settings(),
        )
        self._subscriptions.append(subscription)
        return subscription

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for subscription in self._subscriptions:
            subscription.close()
        self._publisher.close()

    def _produce(self, routed: Sequence[tuple[str, OutgoingMessage, dict[str, str]]],
                 timeout: float | None = None) -> None:
        """Produce each ``(target topic, message, extra headers)``, one wait for all (at most
        ``timeout`` seconds where given)."""
        now = self._clock.time()
        by_target: dict[str, list[Record]] = {}
        for target, message, extra in routed:
            headers = {
                **message.headers,
                ID_HEADER: cast(str, message.message_id),
                PUBLISHED_HEADER: repr(now),
                **extra,
            }
            if message.delay > 0:
                headers[DUE_HEADER] = repr(now + message.delay)
            record = (message.key, message.payload, encode_headers(headers), int(now * 1000))
            by_target.setdefault(target, []).append(record)
        self._publisher.send_all(by_target, timeout=timeout)

    def _consumer_settings(self) -> dict[str, Any]:
        session_ms = int(self._session_timeout * 1000)
        return {
            "session.timeout.ms": session_ms,
            "max.poll.interval.ms": int(self._max_poll_interval * 1000),
            "heartbeat.interval.ms": max(session_ms // 3, 100),
            "socket.timeout.ms": int(self._request_timeout * 1000),
        }

    def _check_name(self, kind: str, name: str) -> None:
        check_kafka_name(kind, name)


