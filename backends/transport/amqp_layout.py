"""Where `amqp://` keeps things in RabbitMQ: exchanges, quorum queues, delay queues, headers.

Topic ``orders`` read by group ``billing``, in namespace ``reliable``
(``:`` separates the parts; names themselves cannot hold one):

====================================  ==============================================
exchange ``reliable:t:orders``        fanout: every group's queue of the topic is bound
queue ``reliable:q:orders:billing``   quorum queue of ``billing``: its members share it;
                                      dead-letters at-least-once to the group's DLQ
queue ``reliable:d:orders:billing:5000``
                                      delay queue (quorum, TTL 5 s) of the group:
                                      expired messages go back to the group's queue
queue ``reliable:p:orders:5000``      delay queue of delayed publishes: expired
                                      messages go to the topic's exchange
queue ``reliable:dlq:billing``        POISON messages with their failure
====================================  ==============================================

A delay is served by the largest bucket of `BUCKETS_MS` not above it; a
message that comes back before its due time (``x-reliable-due``) is sent on to
the next bucket, so a delay of 7 s waits 5 s, then 2 s, never less.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from backends.errors import ConfigurationError, TransportError
from backends.transport.base import (
    DUE_HEADER,
    KEY_HEADER,
    ORIGIN_TOPIC_HEADER,
    PUBLISHED_HEADER,
    Capabilities,
    new_message_id,
)
from backends.types import Message

CAPABILITIES = Capabilities(consumer_offsets=False, drain=True, native_delay=True, dead_letter_queue=True)

BUCKETS_MS = (
    100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000, 3_600_000
)
"""TTLs of the delay queues: any delay is a sum of at most a few of them."""
EARLY_MS = 20
"""A message this close to its due time is delivered rather than sent round again."""

DELIVERED_HEADER = "x-reliable-delivered"
"""Deliveries of the message before this copy was published (a nack's copy counts on)."""
DELIVERY_COUNT_HEADER = "x-delivery-count"
"""Quorum queues' count of returns of this copy (a member that died or closed holding it)."""
INTERNAL_HEADERS = frozenset({KEY_HEADER, DUE_HEADER, DELIVERED_HEADER, PUBLISHED_HEADER, DELIVERY_COUNT_HEADER})

QUORUM = {"x-queue-type": "quorum"}
AT_LEAST_ONCE = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
"""Quorum queues dead-letter at-least-once only when a full queue refuses publishes."""

_LEGAL = re.compile(r"[A-Za-z0-9_.\-]+")
MAX_NAME_LENGTH = 100
"""RabbitMQ allows 255 bytes per queue name; four names and a bucket must fit."""


def check_amqp_name(kind: str, name: str) -> None:
    """A `TransportError` unless ``name`` may be part of a queue name of this layout."""
    if not _LEGAL.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        raise TransportError(
            f"{kind} name {name!r}: amqp:// allows letters, digits, '_', '.' and '-' "
            f"(at most {MAX_NAME_LENGTH} characters)"
        )


class Layout:
    """The RabbitMQ names and queue arguments of one namespace."""

    def __init__(self, namespace: str, replicas: int | None = None) -> None:
        if not isinstance(namespace, str) or not _LEGAL.fullmatch(namespace) or namespace.startswith("amq."):
            raise ConfigurationError(
                f"transport option namespace={namespace!r}: letters, digits, '_', '.' and '-', "
                "not starting with 'amq.'"
            )
        self.namespace = namespace
        self.quorum: dict[str, Any] = dict(QUORUM)
        """A quorum queue's arguments: with ``replicas``, its initial group size (members)."""
        if replicas is not None:
            self.quorum["x-quorum-initial-group-size"] = replicas

    def exchange(self, topic: str) -> str:
        return f"{self.namespace}:t:{topic}"

    def queue(self, topic: str, group: str) -> str:
        return f"{self.namespace}:q:{topic}:{group}"

    def group_delay_queue(self, topic: str, group: str, bucket_ms: int) -> str:
        return f"{self.namespace}:d:{topic}:{group}:{bucket_ms}"

    def publish_delay_queue(self, topic: str, bucket_ms: int) -> str:
        return f"{self.namespace}:p:{topic}:{bucket_ms}"

    def dead_letter_queue(self, group: str) -> str:
        return f"{self.namespace}:dlq:{group}"

    def queue_arguments(self, group: str, single_active_consumer: bool = False) -> dict[str, Any]:
        """A group's work queue: quorum, dead-lettering at-least-once to the group's DLQ.

        With ``single_active_consumer`` one member consumes at a time (the others
        stand by), so messages keep their order across members too.
        """
        arguments: dict[str, Any] = {**self.quorum, **AT_LEAST_ONCE, "x-dead-letter-exchange": "",
                                     "x-dead-letter-routing-key": self.dead_letter_queue(group)}
        if single_active_consumer:
            arguments["x-single-active-consumer"] = True
        return arguments

    def delay_arguments(self, bucket_ms: int, exchange: str, routing_key: str | None) -> dict[str, Any]:
        """A delay queue: its messages expire after ``bucket_ms`` into ``exchange`` (at-least-once)."""
        arguments: dict[str, Any] = {**self.quorum, **AT_LEAST_ONCE, "x-message-ttl": bucket_ms,
                                     "x-dead-letter-exchange": exchange}
        if routing_key is not None:
            arguments["x-dead-letter-routing-key"] = routing_key
        return arguments

    def owned(self, name: str) -> bool:
        """Whether queue or exchange ``name`` belongs to this namespace."""
        return name.startswith(f"{self.namespace}:")


def bucket_for(delay: float) -> int | None:
    """The delay queue (its TTL in ms) a message due in ``delay`` seconds waits in next; None: due now."""
    delay_ms = delay * 1000
    if delay_ms < EARLY_MS:
        return None
    fitting = [bucket for bucket in BUCKETS_MS if bucket <= delay_ms]
    return fitting[-1] if fitting else BUCKETS_MS[0]


def text_headers(raw: Mapping[str | bytes, Any] | None) -> dict[str, str]:
    """AMQP header values as text (pika hands long strings back as str or bytes, counts as int);
    a name that is not UTF-8 (pika hands it back as bytes) as `short_text`."""
    headers: dict[str, str] = {}
    for name, value in (raw or {}).items():
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        headers[short_text(name)] = text
    return headers


def short_text(value: str | bytes) -> str:
    """An AMQP short string (a header name, a message id) as text: pika hands one that is not
    UTF-8 back as bytes; its other bytes are kept as ``\\xNN`` escapes, so two stay distinct."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def delivered_before(headers: Mapping[str, str]) -> int:
    """Deliveries this copy stands for before its current one: earlier copies and quorum returns."""
    return int(headers.get(DELIVERED_HEADER, 0)) + int(headers.get(DELIVERY_COUNT_HEADER, 0))


def to_message(
    topic: str, message_id: str | bytes | None, payload: bytes, headers: Mapping[str, str], receipt: str,
    now: float,
) -> Message:
    """A delivered `Message`: internal headers become its fields."""
    return Message(
        id=short_text(message_id) if message_id else new_message_id(),
        topic=headers.get(ORIGIN_TOPIC_HEADER, topic),
        queue=0,
        offset=-1,
        payload=payload,
        key=headers.get(KEY_HEADER),
        headers={name: value for name, value in headers.items() if name not in INTERNAL_HEADERS},
        attempt=delivered_before(headers) + 1,
        published_at=float(headers.get(PUBLISHED_HEADER, now)),
        receipt=receipt,
    )
