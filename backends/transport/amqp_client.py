"""The pika side of `amqp://`: one blocking connection, its calls serialised; what publishing shares.

Why pika's `BlockingConnection` (``benchmarks/amqp_clients.py`` measures it
against aio-pika on the same quorum queue): the framework calls its
transport from threads, and pika's blocking API consumes with manual acks
about 3.5x faster than aio-pika (whose every delivery and ack crosses an
event loop). Members consume, ack and declare through it.

A message counts as sent only once RabbitMQ has acked it (a publisher
confirm: the quorum queue's majority has it). A negative confirm (RabbitMQ
could not enqueue it, for example while a quorum queue elects a leader)
raises `BackendUnavailableError`, so the caller publishes again. AMQP
transactions were used before (one ``tx.commit`` per batch), but they are
not safe on quorum queues: with the queue's leader killed, ``tx.commit-ok``
came back for messages RabbitMQ had dropped (on 3.10, about 3 s of
publishes lost per leader loss, in ``tests/cluster/test_rabbit_cluster.py``);
under confirms the same messages are nacked and published again.

Every publish, the subscription's settle copies included, goes through
`amqp_publisher.Publisher` (a batch's confirms in flight together on pika's
asynchronous connection, ``benchmarks/amqp_clients.py``), never through a
`Connection`: during a memory or disk alarm RabbitMQ stops reading a
connection that publishes, and a member's acks and heartbeats must go on.

A pika connection is not thread-safe: every call holds the connection's
lock, and a keep-alive thread lets pika answer heartbeats while no other
call is made (a long handler). There is no reconnection inside a
connection: any failure closes it, raises `BackendUnavailableError` (server
unreachable) or `TransportError` (refused), and the owner opens a new one.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pika.frame
import structlog
from pika.adapters.blocking_connection import BlockingChannel
from pika.adapters.utils.connection_workflow import (
    AMQPConnectionWorkflowFailed,
    AMQPConnectorPhaseErrorBase,
)

from backends.errors import (
    BackendUnavailableError,
    ConfigurationError,
    ReliableError,
    TransportError,
    WritesRefusedError,
)
from backends.refusal import FirstContact

log = structlog.get_logger(__name__)
T = TypeVar("T")

KEEP_ALIVE = 1.0
"""Seconds between the keep-alive thread's turns (heartbeats, and the server's closing notices)."""
SHORT_STRING = 255
"""Bytes an AMQP short string holds at most: a message id, a header name."""


@dataclass(frozen=True)
class Publish:
    """One message to publish: where to, and as what."""

    exchange: str
    routing_key: str
    body: bytes
    properties: pika.BasicProperties


def parameters(url: str, heartbeat: float, connect_timeout: float) -> pika.URLParameters:
    """pika's connection parameters for ``amqp://user:password@host:port/vhost``."""
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
        raise ConfigurationError(f"transport URL {url!r}: expected amqp://user:password@host:port/vhost")
    try:
        result = pika.URLParameters(url)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"transport URL {url!r}: {exc}") from exc
    result.heartbeat = max(2, round(heartbeat))
    result.blocked_connection_timeout = connect_timeout * 3
    result.socket_timeout = connect_timeout
    result.stack_timeout = connect_timeout * 2
    result.connection_attempts = 1
    return result


def alternatives(first: pika.URLParameters, servers: Sequence[str]) -> list[pika.URLParameters]:
    """``first`` and the same parameters for each ``host:port`` of ``servers``, tried in this order."""
    found = [first]
    for server in servers:
        host, _, port = server.rpartition(":")
        other = copy.deepcopy(first)
        other.host, other.port = host, int(port)
        found.append(other)
    return found


class RefusedError(TransportError):
    """RabbitMQ closed a channel over a call (404: no such queue, 406: declared otherwise)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def translate(exc: BaseException, doing: str, blocked: str | None = None) -> ReliableError:
    """Our error for a pika exception met while ``doing`` something (``blocked``: the reason
    RabbitMQ gave when it blocked the connection, if it did)."""
    if isinstance(exc, pika.exceptions.ConnectionBlockedTimeout):
        return WritesRefusedError(
            f"amqp: {doing}: RabbitMQ blocked publishing on this connection ({blocked or 'a resource alarm'}): "
            "a memory or disk alarm is in effect on the server (rabbitmqctl status lists it); publishing "
            "resumes once it clears")
    if isinstance(exc, pika.exceptions.ChannelClosedByBroker):
        return RefusedError(f"amqp: {doing}: refused by RabbitMQ: {exc.reply_code} {exc.reply_text}", exc.reply_code)
    if isinstance(exc, pika.exceptions.ConnectionClosedByBroker) and exc.reply_code not in (320, 501, 541):
        # 320 CONNECTION_FORCED (shutdown), 501/541 frame/internal errors: unreachable, not refused
        return TransportError(f"amqp: {doing}: refused by RabbitMQ: {exc.reply_code} {exc.reply_text}")
    return BackendUnavailableError(f"amqp: {doing}: {type(exc).__name__}: {exc}")


LOGIN_REFUSED = (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError)
"""What pika raises when RabbitMQ refuses the URL's login (403 ACCESS_REFUSED) or its virtual
host (530 NOT_ALLOWED: no such vhost, or no access to it)."""


def not_connected(exc: BaseException, doing: str, contact: FirstContact) -> ReliableError:
    """Our error for a connection that could not be made: a refused login or virtual host as
    ``contact`` says (`backends.refusal`), anything else as `translate` does."""
    cause = _workflow_cause(exc)
    if isinstance(cause, LOGIN_REFUSED):
        return contact.refused(f"amqp: {doing}: {cause.args[0] if cause.args else cause}", BackendUnavailableError)
    return translate(exc, doing)


def _workflow_cause(exc: BaseException) -> BaseException:
    """What ``exc`` wraps, where pika's asynchronous connection workflow (the publisher's
    `pika.SelectConnection`) wrapped it; the blocking connection raises the cause itself."""
    while True:
        if isinstance(exc, AMQPConnectionWorkflowFailed) and exc.exceptions:
            exc = exc.exceptions[-1]
        elif isinstance(exc, AMQPConnectorPhaseErrorBase):
            exc = exc.exception
        else:
            return exc


class UnroutableError(TransportError):
    """RabbitMQ returned a message (``mandatory``): no queue took it (none bound, or deleted)."""


def unroutable(doing: str, returned: Sequence[str]) -> UnroutableError:
    """The error for messages RabbitMQ returned (``mandatory``): no queue was bound to take them."""
    return UnroutableError(
        f"amqp: {doing}: {', '.join(sorted(set(returned)))} had no queue to take the message: amqp:// "
        "keeps a message only for the groups that exist when it is published (subscribe them first, or "
        "declare them with Transport.declare)"
    )


def check_frames(messages: Sequence[Publish], frame_max: int, doing: str) -> None:
    """A `TransportError` for a message whose properties (its headers) need a content-header frame
    larger than the connection's ``frame_max``: RabbitMQ would close the connection for it
    (``FRAME_ERROR``), which looks like an outage and would be retried for ever."""
    for message in messages:
        _check_short_strings(message, doing)
        size = len(pika.frame.Header(1, len(message.body), message.properties).marshal())
        if size > frame_max:
            raise TransportError(
                f"amqp: {doing}: message {message.properties.message_id!r}: its headers take {size} bytes, above "
                f"the connection's frame_max={frame_max} (AMQP carries headers in one frame; send large "
                "values in the body)")


def _check_short_strings(message: Publish, doing: str) -> None:
    """A `TransportError` for a message id or header name longer than an AMQP short string
    (255 bytes): pika fails on it with an error of its own, which no caller takes for a refusal."""
    message_id = message.properties.message_id
    named = [("message id", message_id)] if message_id else []
    for what, text in [*named, *(("header name", name) for name in message.properties.headers or {})]:
        size = len(text if isinstance(text, bytes) else text.encode())  # a foreign id that is not UTF-8: bytes
        if size > SHORT_STRING:
            raise TransportError(f"amqp: {doing}: {what} {text[:60]!r}... takes {size} bytes, above AMQP's "
                                 f"{SHORT_STRING} for a short string")


class Blocked:
    """Whether RabbitMQ blocked a connection's publishing (``connection.blocked``: a memory or disk
    alarm, told to a connection once it publishes), and why; logged as it starts and ends."""

    def __init__(self, connection: str) -> None:
        self.connection = connection
        self.reason: str | None = None

    def on_blocked(self, _connection: object, frame: pika.frame.Method) -> None:
        self.reason = str(frame.method.reason or "a resource alarm")
        log.warning("transport.publishing_blocked", connection=self.connection, reason=self.reason)

    def on_unblocked(self, _connection: object, _frame: pika.frame.Method) -> None:
        if self.reason is not None:
            log.info("transport.publishing_unblocked", connection=self.connection, reason=self.reason)
        self.reason = None


FAILURES = (pika.exceptions.AMQPError, OSError, AssertionError)
"""What pika raises when a call cannot finish (AssertionError: a call on a connection pika closed)."""


class Connection:
    """One pika connection: declarations, consuming and acks (it never publishes: RabbitMQ
    blocks a connection that publishes during a memory or disk alarm, its acks with it)."""

    def __init__(self, params: Sequence[pika.URLParameters], name: str, contact: FirstContact) -> None:
        self.name = name
        self._lock = threading.RLock()
        self._closed = threading.Event()
        try:
            self._connection = pika.BlockingConnection(params)
        except FAILURES as exc:
            raise not_connected(exc, f"connect ({name})", contact) from exc
        contact.accepted()
        self.blocked = Blocked(name)
        # on pika's own connection: the blocking one holds its callbacks back while a publish waits
        self._connection._impl.add_on_connection_blocked_callback(self.blocked.on_blocked)
        self._connection._impl.add_on_connection_unblocked_callback(self.blocked.on_unblocked)
        self._keeper = threading.Thread(target=self._keep_alive, name=f"amqp-{name}", daemon=True)
        self._keeper.start()

    @property
    def open(self) -> bool:
        return not self._closed.is_set() and self._connection.is_open

    @contextmanager
    def using(self, doing: str) -> Iterator[None]:
        """Hold the connection for a call; any failure closes it and is translated."""
        with self._lock:
            if not self.open:
                raise BackendUnavailableError(f"amqp: {doing}: the connection ({self.name}) is closed")
            try:
                yield
            except ReliableError:
                raise
            except pika.exceptions.ChannelClosedByBroker as exc:
                raise translate(exc, doing) from exc  # the channel closed; the connection stays
            except FAILURES as exc:
                self.close()
                raise translate(exc, doing, self.blocked.reason) from exc

    def call(self, make: Callable[[], T], doing: str) -> T:
        with self.using(doing):
            return make()

    def channel(self, doing: str) -> BlockingChannel:
        return self.call(self._connection.channel, doing)

    def wait(self, seconds: float, doing: str) -> None:
        """Let pika read for up to ``seconds`` (deliveries reach their callbacks)."""
        with self.using(doing):
            self._connection.process_data_events(seconds)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            try:
                if self._connection.is_open:
                    self._connection.close()
            except FAILURES as exc:
                log.info("transport.close_failed", connection=self.name, error=str(exc))

    def _keep_alive(self) -> None:
        while not self._closed.wait(KEEP_ALIVE):
            try:
                self.wait(0, "keep alive")
            except ReliableError as exc:
                if not self._closed.is_set():
                    log.warning("transport.disconnected", connection=self.name, error=str(exc))
                return
