"""The project's broker as a `Transport`, written once over any `BrokerApi`.

``embedded://DIR`` gives it the engine in process (or, when another process
owns ``DIR``, a client of that process's local socket: `broker.embedded`);
``reliable://host:port`` gives it the server's client. Each subscription is
one group member, joined on its first fetch (so `pending` can look without
taking queues from working members) and joined again if the broker forgot it
(its session timed out, the owning process changed). The broker keeps the
offsets, counts deliveries and delays redeliveries through ``%RETRY%<group>``.
A POISON message is acknowledged without a copy in the broker's
``%DLQ%<group>``: the framework's dead letter lives in the store alone
(`BrokerSubscription.dead_letter` says why).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import structlog

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import BackendUnavailableError, DiskFullError, TransportError
from backends.refusal import FirstContact
from backends.transport.base import (
    ORIGIN_TOPIC_HEADER,
    Capabilities,
    SubscribeOptions,
    Subscription,
    Transport,
    log_dead_letter,
)
from backends.types import Failure, Message, OutgoingMessage
from backends.values import positive
from broker.delivery.api import BrokerApi
from broker.delivery.group import ORIGIN_TOPIC as BROKER_ORIGIN_HEADER
from broker.delivery.topics import check_name as check_broker_name
from broker.delivery.values import Delivery
from broker.delivery.values import OutgoingMessage as BrokerMessage
from broker.errors import (
    BrokerError,
    BrokerUnavailableError,
    DeliveryError,
    InvalidNameError,
    UnknownMemberError,
)
from broker.errors import DiskFullError as BrokerDiskFullError
from broker.protocol.errors import AuthenticationError, LockedOutError

log = structlog.get_logger("backends.transport")
T = TypeVar("T")


@contextmanager
def translated(what: str, contact: FirstContact | None) -> Iterator[None]:
    """The broker's errors as the framework's: unreachable -> `BackendUnavailableError`, a full
    disk -> `DiskFullError` (an outage too: a worker waits it out, a publish is retried), the
    server refusing the URL's login as ``contact`` says (`backends.refusal`)."""
    try:
        yield
    except LockedOutError as exc:  # the address is locked out a while (failed logins, maybe others')
        raise BackendUnavailableError(f"broker refused {what} for now: {exc}") from exc
    except AuthenticationError as exc:  # wrong credentials, or none where the server wants them
        if contact is None:
            raise TransportError(f"broker refused {what}: {exc}") from exc
        raise contact.refused(f"broker: {what}: {exc}", BackendUnavailableError) from exc
    except BrokerDiskFullError as exc:
        raise DiskFullError(f"broker cannot write during {what}: {exc}") from exc
    except OSError as exc:  # a connection lost, or a file of the engine's that could not be written
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"broker cannot write during {what}: the disk is full ({exc})") from exc
        raise BackendUnavailableError(f"broker unavailable during {what}: {exc}") from exc
    except BrokerUnavailableError as exc:
        raise BackendUnavailableError(f"broker unavailable during {what}: {exc}") from exc
    except DeliveryError as exc:
        raise TransportError(f"broker refused {what}: {exc}") from exc
    except BrokerError as exc:
        raise TransportError(f"broker failed {what}: {exc}") from exc
    else:
        if contact is not None:
            contact.accepted()


class BrokerTransport(Transport):
    """A `Transport` over a `BrokerApi` (the engine in process, or a client of one)."""

    capabilities = Capabilities(consumer_offsets=False, drain=True, native_delay=True)
    names_messages = True  # an unnamed message gets the broker's id, cheaper than a uuid per message

    def __init__(self, api: BrokerApi, clock: Clock = SYSTEM_CLOCK, *,
                 visibility_timeout: float = 30.0, owns_api: bool = True) -> None:
        self.api = api
        self._clock = clock
        self._lease = float(positive("transport option visibility_timeout", visibility_timeout))
        self._owns_api = owns_api
        self.contact: FirstContact | None = None  # a server's login (`reliable://`): its history

    def _check_name(self, kind: str, name: str) -> None:
        try:
            check_broker_name(kind, name)
        except InvalidNameError as exc:
            raise TransportError(str(exc)) from None

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        _check_keys(messages)
        with translated(f"publish to {topic!r}", self.contact):
            self._publish(topic, [self._outgoing(m) for m in messages], timeout)

    def _publish(self, topic: str, messages: list[BrokerMessage], timeout: float | None) -> None:
        """The engine's publish; in process it waits on nothing, so ``timeout`` is not needed."""
        self.api.publish(topic, messages)

    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        _check_keys(messages)
        with translated(f"publish to group {group!r}", self.contact):
            self.api.publish_to_group(group, topic, [self._outgoing(m) for m in messages])

    def subscribe(self, group: str, topics: Sequence[str],
                  options: SubscribeOptions | None = None) -> Subscription:
        return BrokerSubscription(self, group, topics, options or SubscribeOptions())

    def close(self) -> None:
        if self._owns_api and not self._closed:
            self.api.close()
        self._closed = True

    def _outgoing(self, message: OutgoingMessage) -> BrokerMessage:
        deliver_at = self._clock.time() + message.delay if message.delay > 0 else 0.0
        return BrokerMessage(message.payload, message.key or "", "", dict(message.headers),
                             message.message_id or "", None, deliver_at)


def _check_keys(messages: Sequence[OutgoingMessage]) -> None:
    """A `TransportError` for an empty key: the broker keeps a message without a key under an
    empty one, so it would arrive as no key (``None``), kept in no key's order."""
    if any(message.key == "" for message in messages):
        raise TransportError("message key '': the broker keeps an empty key as no key; publish with key=None, "
                             "or a key of at least one character")


class BrokerSubscription(Subscription):
    """One member of ``group``: joined on first fetch, joined again when the broker forgot it."""

    capabilities = BrokerTransport.capabilities

    def __init__(self, transport: BrokerTransport, group: str, topics: Sequence[str],
                 options: SubscribeOptions) -> None:
        super().__init__(group, topics, options)
        self._transport = transport
        self._api = transport.api
        self._lease = options.lease or transport._lease
        self._member: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    def fetch(self, max_messages: int, timeout: float) -> list[Message]:
        self._check_fetch(max_messages)
        deliveries = self._as_member("fetch", lambda m: self._api.fetch(m, max_messages, timeout))
        return [self._message(d) for d in deliveries or ()]

    def ack(self, messages: Sequence[Message]) -> None:
        if messages:
            self._as_member("ack", lambda m: self._api.ack(m, _receipts(messages)), rejoin=False)

    def nack(self, message: Message, delay: float) -> None:
        self._as_member("nack", lambda m: self._api.nack(m, _receipts([message]), delay), rejoin=False)

    def dead_letter(self, message: Message, failure: Failure) -> None:
        """POISON, as the framework's: done for the group, with no copy in ``%DLQ%<group>``.

        The store's dead-letter record is the one a framework user lists and
        replays (``reliable dlq``); a broker copy could only be replayed a
        second time by ``reliable broker dlq replay``, which is for programs
        that use the broker directly.
        """
        self._as_member("dead_letter", lambda m: self._api.ack(m, _receipts([message])), rejoin=False)
        log_dead_letter(self.group, message, failure)

    def in_progress(self, messages: Sequence[Message]) -> None:
        if messages:
            self._as_member("in_progress", lambda m: self._api.extend(m, _receipts(messages)),
                            rejoin=False)

    def pending(self) -> int:
        if self._closed:
            raise TransportError(f"this member of group {self.group!r} is closed")
        with translated("pending", self._transport.contact):
            return int(self._api.pending(self.group, list(self.topics)))

    def next_due(self) -> float | None:
        with translated("next_due", self._transport.contact):
            due = self._api.next_due(self.group)
        return None if due is None else float(due)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            member, self._member = self._member, None
        if member is not None:
            try:
                self._api.leave(member)
            except (BrokerError, OSError) as exc:  # the broker forgets it at its session timeout
                log.warning("transport.leave_failed", group=self.group, error=str(exc))

    def _as_member(self, what: str, call: Callable[[str], T], *, rejoin: bool = True) -> T | None:
        """``call(member)``, joining first if needed; a forgotten member joins again (fetch) or
        lets the stale call go (acks of a forgotten member's messages: they come back anyway)."""
        with translated(what, self._transport.contact):
            for _ in range(2):
                member = self._joined()
                try:
                    return call(member)
                except UnknownMemberError:
                    with self._lock:
                        if self._member == member:
                            self._member = None
                    if not rejoin:
                        log.info("transport.stale_ack", group=self.group, call=what)
                        return None
        return None

    def _joined(self) -> str:
        with self._lock:
            if self._closed:
                raise TransportError(f"this member of group {self.group!r} is closed")
            if self._member is None:
                self._member = self._api.join(self.group, list(self.topics),
                                              prefetch=self.options.prefetch, lease=self._lease)
            return self._member

    def _message(self, delivery: Delivery) -> Message:
        headers = dict(delivery.headers)
        origin = headers.get(BROKER_ORIGIN_HEADER)
        if origin is not None:
            headers.setdefault(ORIGIN_TOPIC_HEADER, origin)
        return Message(id=delivery.message_id, topic=delivery.topic, queue=delivery.queue,
                       offset=delivery.offset, payload=delivery.body, key=delivery.key or None,
                       headers=headers, attempt=delivery.delivery_count,
                       published_at=delivery.published_at, receipt=delivery.receipt)


def _receipts(messages: Sequence[Message]) -> list[str]:
    receipts = [m.receipt for m in messages]
    if any(r is None for r in receipts):
        raise TransportError("a message without a broker receipt cannot be acknowledged here")
    return [r for r in receipts if r is not None]
