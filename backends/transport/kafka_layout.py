"""Where `kafka://` keeps things: topic names, delay buckets, headers, receipts.

A topic ``orders`` read by group ``billing`` uses these Kafka topics:

======================================  =============================================
``orders``                              the messages as published
``orders-delayed-<ms>``                 publishes with ``delay > 0``; every group reads
                                        them and holds each back until its due time
``orders-retry-billing-<ms>``           ``nack(delay)`` copies and ``publish_to_group``
                                        (bucket 0): read by ``billing`` alone
``orders-dlt-billing``                  POISON messages with their failure
======================================  =============================================

``<ms>`` is a delay bucket: the smallest of `BUCKETS` not below the delay (the
largest for longer delays). A message waits for its own due time, not its
bucket's; within one bucket a copy may wait behind an earlier one due later,
at most by the bucket's width.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backends.errors import TransportError
from backends.transport.base import (
    DUE_HEADER,
    ID_HEADER,
    ORIGIN_TOPIC_HEADER,
    PUBLISHED_HEADER,
    Capabilities,
)
from backends.types import Failure, Message, OutgoingMessage, readable, text_bytes, text_from_bytes

CAPABILITIES = Capabilities(
    consumer_offsets=True, drain=False, native_delay=False, dead_letter_queue=True, reads_in_order=True
)

BUCKETS_MS = (1_000, 5_000, 30_000, 120_000, 600_000, 3_600_000)
"""Delay buckets (1s 5s 30s 2m 10m 1h), each its own topic; 0 is the group's no-delay bucket."""

DELIVERY_COUNT_HEADER = "x-reliable-delivery-count"
"""Deliveries before this copy: a message's ``attempt`` is 1 + this."""
FIRST_FAILURE_HEADER = "x-reliable-first-failure"
ERROR_TYPE_HEADER = "x-reliable-error-type"
ERROR_MESSAGE_HEADER = "x-reliable-error-message"
TRACEBACK_HEADER = "x-reliable-traceback"
ATTEMPTS_HEADER = "x-reliable-attempts"
LAST_FAILURE_HEADER = "x-reliable-last-failure"
ORIGIN_QUEUE_HEADER = "x-reliable-origin-queue"
ORIGIN_OFFSET_HEADER = "x-reliable-origin-offset"
INTERNAL_HEADERS = frozenset(
    {ID_HEADER, DELIVERY_COUNT_HEADER, DUE_HEADER, FIRST_FAILURE_HEADER, PUBLISHED_HEADER}
)
"""Headers the transport reads back into `Message` fields instead of passing them on."""

_LEGAL = re.compile(r"[A-Za-z0-9._-]+")
MAX_TOPIC_LENGTH = 249


def check_kafka_name(kind: str, name: str) -> None:
    """A `TransportError` unless ``name`` can be part of a Kafka topic name."""
    if not isinstance(name, str) or not _LEGAL.fullmatch(name):
        raise TransportError(
            f"{kind} name {name!r}: Kafka allows only letters, digits, '.', '_' and '-'"
        )
    if len(name) > MAX_TOPIC_LENGTH - 40:
        raise TransportError(f"{kind} name {name!r}: too long for Kafka topic names")


def check_header_names(messages: Sequence[OutgoingMessage]) -> None:
    """A `TransportError` for a header name holding a NUL: librdkafka takes a name as a C string
    and would send only what comes before it."""
    for message in messages:
        for name in message.headers:
            if "\x00" in name:
                raise TransportError(f"header name '{readable(name)}': kafka:// cannot carry a NUL in a header "
                                     "name (librdkafka would cut the name there)")


def bucket_ms(delay: float) -> int:
    """The delay bucket (milliseconds) a delay of ``delay`` seconds waits in; 0 for none."""
    if delay <= 0:
        return 0
    wanted = delay * 1000
    return next((bucket for bucket in BUCKETS_MS if bucket >= wanted), BUCKETS_MS[-1])


def delayed_topic(topic: str, bucket: int) -> str:
    return f"{topic}-delayed-{bucket}"


def retry_topic(topic: str, group: str, bucket: int) -> str:
    return f"{topic}-retry-{group}-{bucket}"


def dead_letter_topic(topic: str, group: str) -> str:
    return f"{topic}-dlt-{group}"


def topics_read(group: str, topic: str) -> list[str]:
    """Every Kafka topic a member of ``group`` reads for ``topic``."""
    return [
        topic,
        *(delayed_topic(topic, bucket) for bucket in BUCKETS_MS),
        *(retry_topic(topic, group, bucket) for bucket in (0, *BUCKETS_MS)),
    ]


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a delivered message is acknowledged through: its place and delivery count."""

    topic: str
    queue: int
    offset: int
    attempt: int

    def encode(self) -> str:
        return f"{self.attempt}/{self.queue}/{self.offset}/{self.topic}"

    @classmethod
    def of(cls, message: Message) -> Receipt:
        """The receipt ``message`` was delivered with; a `TransportError` if it has none."""
        try:
            attempt, queue, offset, topic = (message.receipt or "").split("/", 3)
            return cls(topic, int(queue), int(offset), int(attempt))
        except ValueError:
            raise TransportError(
                f"message {message.id!r} has no kafka:// receipt {message.receipt!r}: "
                "acknowledge messages fetched from this transport"
            ) from None


@dataclass(frozen=True)
class Delivered:
    """A partition's offsets below ``end`` were delivered ``times`` more than their headers count.

    A member that leaves with messages fetched and not finished commits its done
    prefix only, so the next owner reads those again from the partition, in
    order; this note, the commit's metadata, has them counted (``attempt``).
    """

    end: int
    times: int

    PREFIX = "reliable-delivered:"

    def encode(self) -> str:
        return f"{self.PREFIX}{self.end}:{self.times}"

    @classmethod
    def decode(cls, metadata: str | None) -> Delivered | None:
        """The note in a commit's ``metadata``; None for none (or another program's)."""
        end, _, times = (metadata or "").removeprefix(cls.PREFIX).partition(":")
        if not (metadata or "").startswith(cls.PREFIX) or not end.isdigit() or not times.isdigit():
            return None
        return cls(int(end), int(times))

    def count(self, offset: int) -> int:
        return self.times if offset < self.end else 0

    @classmethod
    def after(cls, before: Delivered | None, unfinished: Sequence[int]) -> Delivered:
        """The note once the messages at ``unfinished`` offsets were delivered once more."""
        times = 1 + max((before.count(offset) for offset in unfinished), default=0) if before else 1
        return cls(max(max(unfinished) + 1, before.end if before else 0), times)


RawHeaders = Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]] | None


def decode_headers(raw: RawHeaders) -> dict[str, str]:
    """A Kafka record's headers as text (a repeated name keeps its last value); a value that is
    not UTF-8 keeps its bytes as `text_from_bytes` does, so `encode_headers` sends them back."""
    pairs = raw.items() if isinstance(raw, Mapping) else raw or []
    return {name: _text(value) for name, value in pairs}


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return text_from_bytes(value)
    return value or ""


def encode_headers(headers: Mapping[str, str]) -> list[tuple[str, str | bytes | None]]:
    return [(name, text_bytes(value)) for name, value in headers.items()]


def due_at(headers: Mapping[str, str]) -> float:
    """When a held-back copy is due (0: at once)."""
    return float(headers.get(DUE_HEADER, 0) or 0)


def failure_headers(failure: Failure, message: Message) -> dict[str, str]:
    """The dead-letter topic's headers: the failure and where the message came from."""
    return {
        ERROR_TYPE_HEADER: failure.error_type,
        ERROR_MESSAGE_HEADER: failure.error_message,
        TRACEBACK_HEADER: failure.traceback,
        ATTEMPTS_HEADER: str(failure.attempts),
        FIRST_FAILURE_HEADER: repr(failure.first_failure_at),
        LAST_FAILURE_HEADER: repr(failure.last_failure_at),
        ORIGIN_QUEUE_HEADER: str(message.queue),
        ORIGIN_OFFSET_HEADER: str(message.offset),
    }


def failure_of(headers: Mapping[str, str]) -> Failure:
    """The `Failure` a dead-letter topic's message carries."""
    return Failure(
        headers[ERROR_TYPE_HEADER],
        headers[ERROR_MESSAGE_HEADER],
        headers[TRACEBACK_HEADER],
        int(headers[ATTEMPTS_HEADER]),
        float(headers[FIRST_FAILURE_HEADER]),
        float(headers[LAST_FAILURE_HEADER]),
    )


def copy_headers(message: Message, origin: str, extra: Mapping[str, str]) -> dict[str, str]:
    """Headers of a copy of ``message`` (retry, dead letter): its own, its id and origin, ``extra``."""
    headers = {name: value for name, value in message.headers.items() if name not in INTERNAL_HEADERS}
    headers[ID_HEADER] = message.id
    headers[ORIGIN_TOPIC_HEADER] = origin
    headers[PUBLISHED_HEADER] = repr(message.published_at)
    if message.first_failure_at is not None:
        headers[FIRST_FAILURE_HEADER] = repr(message.first_failure_at)
    headers.update(extra)
    return headers


def to_message(topic: str, queue: int, offset: int, key: bytes | None, value: bytes | None,
               headers: dict[str, str], timestamp_ms: int, delivered: Delivered | None = None) -> Message:
    """A delivered `Message` from a Kafka record; internal headers become its fields."""
    attempt = 1 + int(headers.get(DELIVERY_COUNT_HEADER, 0) or 0) + (delivered.count(offset) if delivered else 0)
    first_failure = headers.get(FIRST_FAILURE_HEADER)
    published = headers.get(PUBLISHED_HEADER)
    return Message(
        id=headers.get(ID_HEADER) or f"{topic}-{queue}-{offset}",
        topic=topic,
        queue=queue,
        offset=offset,
        payload=value or b"",
        key=text_from_bytes(key) if key is not None else None,
        headers={name: value for name, value in headers.items() if name not in INTERNAL_HEADERS},
        attempt=attempt,
        published_at=float(published) if published else timestamp_ms / 1000,
        first_failure_at=float(first_failure) if first_failure else None,
        receipt=Receipt(topic, queue, offset, attempt).encode(),
    )
