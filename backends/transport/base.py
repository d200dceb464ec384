"""The `Transport` contract: publish, subscribe a group member, acknowledge through receipts.

A `Transport` publishes and opens `Subscription`s. A subscription is one
member of a consumer group on some topics; it fetches messages and
acknowledges each through the message's opaque ``receipt``:

==================  ==========  ===============================================
call                ack type    meaning
==================  ==========  ===============================================
``ack``             STANDARD    done; never deliver again to this group
``nack(delay)``     REDELIVERED deliver again after ``delay`` seconds; the
                                transport counts deliveries (``attempt``)
``dead_letter``     POISON      never deliver again; the transport may keep it
                                in its own ``%DLQ%<group>``
``in_progress``     (renew)     still working: extend the message's lease
==================  ==========  ===============================================

A fetched message neither acked, nacked nor dead-lettered comes back when its
lease ends (the member is presumed dead). The transport, not the caller,
owns the delivery count and where a redelivery waits (natively, or in a
``%RETRY%<group>`` queue).

Optional capabilities are declared in `Capabilities`, never faked:

* ``consumer_offsets``: the consumer keeps the group's position. When queues
  are assigned, `SubscribeOptions.on_assign` returns the saved offsets and
  the subscription seeks there; ``commit`` records the contiguous prefix of
  done offsets (the worker's `OffsetWatermark`). Without it, ``commit`` raises.
  With ``reads_in_order`` too, offsets a fetch skipped count as done.
* ``drain``: ``pending`` and ``next_due`` can tell that nothing is left for
  the group, which ``App.run(until_idle=True)`` needs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Self

import structlog

from backends.errors import ConfigurationError, TransportError
from backends.types import (
    Failure,
    Message,
    OutgoingMessage,
    QueueRef,
    new_message_id,
    not_text,
    readable,
    text_bytes,
)
from backends.values import positive

_log = structlog.get_logger("backends.transport")
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
ORIGIN_TOPIC_HEADER = "x-reliable-origin-topic"
"""The topic a message sent to one group only (a replay) was first published to."""
# where a wire has no field of its own for them, a message's fields travel in these headers
ID_HEADER = "x-reliable-id"
KEY_HEADER = "x-reliable-key"
DUE_HEADER = "x-reliable-due"
PUBLISHED_HEADER = "x-reliable-published-at"

Assign = Callable[[Sequence[QueueRef]], Mapping[QueueRef, int]]
"""Called with the queues a member was given; returns saved offsets to seek to (may be empty)."""

Revoke = Callable[[Sequence[QueueRef]], None]
"""Called with the queues a member is about to lose, before another member may take them."""


def retry_queue_name(group: str) -> str:
    """``%RETRY%<group>``: where messages meant for ``group`` alone wait."""
    return f"{RETRY_PREFIX}{group}"


def dead_letter_queue_name(group: str) -> str:
    """``%DLQ%<group>``: a transport's own dead-letter queue for ``group``."""
    return f"{DLQ_PREFIX}{group}"


def log_dead_letter(group: str, message: Message, failure: Failure) -> None:
    """The POISON ack, logged the same way by every transport."""
    _log.info(
        "transport.dead_letter",
        group=group,
        topic=message.topic,
        queue=message.queue,
        offset=message.offset,
        attempt=message.attempt,
        error_type=failure.error_type,
    )


def origin_topic(message: Message) -> str:
    """The topic ``message`` belongs to, also when it came through ``%RETRY%<group>``."""
    return message.headers.get(ORIGIN_TOPIC_HEADER, message.topic)


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do beyond the core calls."""

    consumer_offsets: bool = False
    """The consumer keeps the position: seek on assignment, ``commit`` of done offsets."""
    drain: bool = False
    """``pending``/``next_due`` tell when nothing is left for the group."""
    native_delay: bool = True
    """``nack(delay)`` waits inside the engine (else the transport routes via ``%RETRY%``)."""
    dead_letter_queue: bool = False
    """POISON messages are kept in the transport's own ``%DLQ%<group>`` as well."""
    reads_in_order: bool = False
    """Each queue is read in order by one member: offsets skipped between fetched messages hold
    nothing to deliver (transaction markers, compacted records) and count as done."""


@dataclass(frozen=True)
class SubscribeOptions:
    """How a member consumes: prefetch, lease, and the assignment callbacks."""

    prefetch: int = 100
    """Messages a member may hold unacknowledged (where the engine enforces a window)."""
    lease: float | None = None
    """Seconds a fetched message stays with its member (visibility timeout, AckWait);
    None takes the transport's default."""
    on_assign: Assign | None = None
    on_revoke: Revoke | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise TransportError(f"subscribe option prefetch={self.prefetch!r}: an integer >= 1 is required")
        if self.lease is not None:
            positive("subscribe option lease", self.lease, TransportError)


class Subscription(ABC):
    """One member of a consumer group on some topics."""

    capabilities: Capabilities

    def __init__(self, group: str, topics: Sequence[str], options: SubscribeOptions) -> None:
        check_name("group", group)
        if not topics:
            raise TransportError(f"group {group!r}: subscribe to at least one topic")
        for topic in topics:
            check_name("topic", topic)
        self.group = group
        self.topics = tuple(topics)
        self.options = options

    @abstractmethod
    def fetch(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` due messages, waiting at most ``timeout`` seconds for one."""

    @abstractmethod
    def ack(self, messages: Sequence[Message]) -> None:
        """STANDARD: ``messages`` are done for the group."""

    @abstractmethod
    def nack(self, message: Message, delay: float) -> None:
        """REDELIVERED: deliver ``message`` again after ``delay`` seconds, counting the delivery."""

    @abstractmethod
    def dead_letter(self, message: Message, failure: Failure) -> None:
        """POISON: never deliver ``message`` to the group again."""

    def in_progress(self, messages: Sequence[Message]) -> None:
        """Still working on ``messages``: extend their leases (JetStream's +WPI)."""

    def commit(self, offsets: Mapping[QueueRef, int]) -> None:
        """Record the group's position (next offset to read) per queue: ``consumer_offsets`` only."""
        raise TransportError(f"{type(self).__name__} does not keep consumer offsets")

    def pending(self) -> int:
        """Messages not yet done for the group, scheduled redeliveries included: ``drain`` only."""
        raise TransportError(f"{type(self).__name__} cannot tell what is pending")

    def next_due(self) -> float | None:
        """When the earliest scheduled redelivery falls due, or None: ``drain`` only."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Leave the group; unacknowledged messages go to other members."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_fetch(self, max_messages: int) -> None:
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise TransportError(f"max_messages={max_messages!r}: must be an integer >= 1")


class Transport(ABC):
    """Publishes messages and subscribes members of consumer groups.

    ``publish`` and ``publish_to_group`` are written once here: the closed,
    name and message checks, a message id for every message that has none,
    and the origin topic of a message sent to one group. A transport
    implements only its send primitives (`_send`, `_send_to_group`) and, where
    its wire restricts names, `_check_name`.
    """

    capabilities: Capabilities
    names_messages: ClassVar[bool] = False
    """The engine gives a message published without an id its own (the broker): none is stamped."""
    binary_fields: ClassVar[bool] = False
    """Keys and header values travel as bytes (Kafka): ones read from bytes that are not UTF-8
    (`backends.types.text_from_bytes`) can be sent back."""
    _closed: bool = False

    def publish(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        """Append ``messages`` to ``topic``; a message with ``delay`` is delivered later.

        ``timeout``: seconds the caller has left (``App.publish``'s last try, bounded by
        ``publish_timeout``); each request to the server waits at most that long, instead of the
        transport's own ``request_timeout``. None: the transport's own bounds."""
        self._check_open()
        self.check_topic(topic)
        check_outgoing(messages, binary_fields=self.binary_fields)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"publish timeout={timeout!r}: must be > 0 seconds")
        if messages:
            self._send(topic, self._stamped(messages, None), timeout=timeout)

    def publish_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        """Deliver ``messages`` of ``topic`` to ``group`` only (a dead-letter replay), each
        carrying ``topic`` in `ORIGIN_TOPIC_HEADER`."""
        self._check_open()
        self._check_names(group=group, topic=topic)
        check_outgoing(messages, binary_fields=self.binary_fields)
        if messages:
            self._send_to_group(group, topic, self._stamped(messages, topic))

    def check_topic(self, topic: str) -> None:
        """A `TransportError` unless ``publish`` takes ``topic`` as a name (``tx.publish`` asks
        before it writes a row the relay could never send)."""
        self._check_names(topic=topic)
        if topic.startswith((RETRY_PREFIX, DLQ_PREFIX)):  # a group's own: publish_to_group reaches it
            raise TransportError(f"topic name {topic!r}: names starting with {RETRY_PREFIX} or {DLQ_PREFIX} are "
                                 "the transport's own queues of a group")

    @abstractmethod
    def subscribe(
        self, group: str, topics: Sequence[str], options: SubscribeOptions | None = None
    ) -> Subscription:
        """A new member of ``group`` on ``topics`` (and on the group's ``%RETRY%`` queue)."""

    def declare(self, group: str, topics: Sequence[str]) -> None:
        """Keep what is published to ``topics`` from now on for ``group``, before any member joins.

        A no-op where every group reads a topic's whole log; a queue broker
        (``amqp://``) keeps a message only for the groups it knows of.
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections and files."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- primitives, per transport ----------------------------------------------------------

    @abstractmethod
    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        """Send checked, stamped ``messages`` (at least one) to ``topic``, each request waiting at
        most ``timeout`` seconds where it is given (`publish`)."""

    @abstractmethod
    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        """Send checked, stamped ``messages`` (at least one) of ``topic`` to ``group`` only."""

    def _check_name(self, kind: str, name: str) -> None:
        """Refuse a ``kind`` name (topic, group) the transport's wire cannot carry."""

    # -- written once -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{type(self).__name__} is closed")

    def _check_names(self, **names: str) -> None:
        for kind, name in names.items():
            check_name(kind, name)
            self._check_name(kind, name)

    def _stamped(self, messages: Sequence[OutgoingMessage], origin: str | None) -> Sequence[OutgoingMessage]:
        """``messages`` each with an id (unless the engine names them) and, for a group, its origin."""
        if origin is None and (self.names_messages or all(m.message_id for m in messages)):
            return messages
        return [
            OutgoingMessage(
                m.payload, m.key,
                m.headers if origin is None else {**m.headers, ORIGIN_TOPIC_HEADER: origin},
                m.delay, m.message_id or (None if self.names_messages else new_message_id()),
            )
            for m in messages
        ]


def check_name(kind: str, name: str) -> None:
    """A `TransportError` unless ``name`` is a non-empty string with a UTF-8 form."""
    if not isinstance(name, str) or not name:
        raise TransportError(f"{kind} name {name!r}: a non-empty string is required")
    if not_text(name):
        raise TransportError(f"{kind} name '{readable(name)}' holds a lone surrogate: no wire carries it")


def check_outgoing(messages: Sequence[OutgoingMessage], *, binary_fields: bool = False) -> None:
    """A `TransportError` naming the first message a transport cannot publish: a payload not
    bytes, a delay not a finite number >= 0, a key, message id, header name or value not a str
    (a client library fails on each in a way of its own: librdkafka's crashes the process on a
    header name with no UTF-8 form), and a key or header value holding bytes that are not UTF-8
    (`backends.types.text_from_bytes`) only where ``binary_fields``."""
    for message in messages:
        if not isinstance(message.payload, bytes):
            raise TransportError(f"message payload must be bytes, got {type(message.payload).__name__}")
        if not isinstance(message.delay, int | float) or not math.isfinite(message.delay) or message.delay < 0:
            raise TransportError(f"message delay {message.delay!r}: must be a finite number of seconds >= 0")
        if message.key is not None:
            _check_text("message key", message.key, binary_fields)
        if message.message_id is not None:
            _check_text("message id", message.message_id, False)
        if not isinstance(message.headers, Mapping):
            raise TransportError(f"message headers must map names to values, got {type(message.headers).__name__}")
        for name, value in message.headers.items():
            if not isinstance(name, str) or not_text(name):
                shown = f"'{readable(name)}'" if isinstance(name, str) else _shown(name)
                raise TransportError(f"header name {shown}: a str with a UTF-8 form is required")
            _check_text(f"header {name!r}", value, binary_fields)


def _check_text(what: str, value: object, binary_fields: bool) -> None:
    if not isinstance(value, str):
        raise TransportError(f"{what} {_shown(value)}: a str is required, got {type(value).__name__}")
    if not_text(value):
        _check_bytes(what, value, binary_fields)


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:80]}..."


def _check_bytes(what: str, value: str, binary_fields: bool) -> None:
    try:
        text_bytes(value)
    except UnicodeEncodeError:
        raise TransportError(f"{what} '{readable(value)}' holds a lone surrogate, which stands for no "
                             "byte: not text read from bytes") from None
    if not binary_fields:
        raise TransportError(f"{what} '{readable(value)}' holds bytes that are not UTF-8 (read from Kafka?): "
                             "this transport carries text only")


def seconds(name: str, value: float | str) -> float:
    """``value`` (a number, or its text from the URL) if positive, else a `ConfigurationError`."""
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        number = 0.0
    return float(positive(f"transport option {name}", number, original=value))


def count(name: str, value: int | str) -> int:
    """``value`` (an integer, or its text from the URL) if positive, else a `ConfigurationError`."""
    number = value if not isinstance(value, str) else int(value) if value.isdigit() else 0
    return positive(f"transport option {name}", number, original=value, integer=True)


def server_list(servers: Sequence[str] | str) -> list[str]:
    """The ``servers`` option as a list of ``host:port``: given as a list, or as the URL's ``a:1,b:2``."""
    listed = servers.split(",") if isinstance(servers, str) else list(servers)
    for server in listed:
        host, colon, port = server.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(f"transport option servers: {server!r} is not host:port (port 1-65535)")
    return listed


def with_servers(url: str, servers: Sequence[str] | str) -> str:
    """``url`` (``scheme://host:port[,host:port]...``) with ``servers`` added to its list of servers."""
    extra = server_list(servers)
    if not extra:
        return url
    head, question, query = url.partition("?")
    return f"{head.rstrip('/')},{','.join(extra)}{question}{query}"
