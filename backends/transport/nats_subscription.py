"""One member of a group on `nats://`: durable pull consumers, acks through reply subjects.

Per topic the group has two durable pull consumers on the topic's stream (see
`nats_layout`): one on the published messages, one on the group's own
subject. Every member of the group pulls from the same consumers, so
JetStream shares the work among them. A message's ``receipt`` is its ack
reply subject; acknowledging publishes JetStream's ack protocol to it:
``+ACK``, ``-NAK {"delay": ns}``, ``+TERM``, ``+WPI``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NoStreamResponseError

from backends.clock import Clock
from backends.errors import BackendUnavailableError, TransportError
from backends.transport.base import (
    ORIGIN_TOPIC_HEADER,
    SubscribeOptions,
    Subscription,
    origin_topic,
)
from backends.transport.kafka_layout import failure_headers
from backends.transport.nats_client import Connection
from backends.transport.nats_layout import (
    CAPABILITIES,
    ID_HEADER,
    INTERNAL_HEADERS,
    KEY_HEADER,
    Layout,
    check_nats_message,
    check_nats_name,
    due_at,
    one_line,
    to_message,
)
from backends.transport.nats_streams import Streams, deleted
from backends.types import Failure, Message

log = structlog.get_logger(__name__)

POLL = 0.5
"""Seconds the waiting pull of a round waits at most (a round asks every consumer once)."""
NO_WAIT = 0.01
"""Seconds the other pulls of a round wait: long enough for the server's answer on a LAN."""
ACK, TERM, WPI = b"+ACK", b"+TERM", b"+WPI"


class Durables:
    """When JetStream created each durable consumer one transport's members pull from: a consumer
    created anew since (``nats consumer rm``, its stream deleted) is made again under its group,
    which reads the stream again from its start, and says so (``transport.group_recreated``)."""

    def __init__(self) -> None:
        self._created: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def made_again(self, stream: str, durable: str, created: object) -> bool:
        """Record that ``durable`` on ``stream`` was created at ``created``; True if it was
        created at another time before."""
        with self._lock:
            before = self._created.get((stream, durable))
            self._created[(stream, durable)] = created
        return before is not None and before != created


class NatsSubscription(Subscription):
    """A member of a group on JetStream (see `backends.transport.nats_transport`)."""

    def __init__(
        self,
        group: str,
        topics: Sequence[str],
        options: SubscribeOptions,
        *,
        connection: Connection,
        layout: Layout,
        ensure_stream: Callable[[str], None],
        streams: Streams,
        durables: Durables,
        ack_wait: float,
        clock: Clock,
    ) -> None:
        super().__init__(group, topics, options)
        check_nats_name("group", group)
        for topic in self.topics:
            check_nats_name("topic", topic)
        self.capabilities = CAPABILITIES
        self._connection = connection
        self._layout = layout
        self._streams = streams
        self._durables = durables
        self._clock = clock
        self._ack_wait = options.lease or ack_wait
        self._lock = threading.Lock()
        self._open: set[str] = set()
        self._closed = False
        self._pulls: list[tuple[str, Any]] = []
        for topic in self.topics:
            ensure_stream(topic)
            main, own = layout.consumers(group)
            for durable, subject in ((main, layout.subject(topic)), (own, layout.group_subject(topic, group))):
                self._pulls.append((topic, connection.guarded(
                    partial(self._pull, topic, durable, subject), f"subscribe {group!r} to {topic!r}"
                )))
        self._next = 0

    async def _pull(self, topic: str, durable: str, subject: str) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self._ack_wait,
            max_deliver=-1,  # the framework's redelivery policy decides when a message is poison
            max_ack_pending=-1,
            filter_subject=subject,
        )
        stream = self._layout.stream(topic)
        info = await self._connection.js.add_consumer(stream, config)
        if self._durables.made_again(stream, durable, info.created):
            state = (await self._connection.js.stream_info(stream)).state
            first = state.first_seq if state.messages else state.last_seq + 1  # empty: the next one published
            log.warning("transport.group_recreated", group=self.group, topic=topic, consumer=durable, offset=first,
                        reason="the group's durable consumer was deleted from JetStream (or its stream) and made "
                               "again: it reads the stream again from this offset, its start (what was done is "
                               "skipped by its token)")
        return await self._connection.js.pull_subscribe_bind(durable, stream)

    def fetch(self, max_messages: int, timeout: float) -> list[Message]:
        self._check_fetch(max_messages)
        self._check_open()
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            # every consumer but the last of the round is asked without waiting; the last waits
            start, self._next = self._next, (self._next + 1) % len(self._pulls)
            for step in range(len(self._pulls)):
                topic, pull = self._pulls[(start + step) % len(self._pulls)]
                last = step == len(self._pulls) - 1
                wait = max(NO_WAIT, min(POLL, deadline - time.monotonic())) if last else NO_WAIT
                messages = self._accept(topic, self._connection.guarded(
                    partial(_fetch, pull, max_messages, wait), f"fetch for group {self.group!r}", wait + 10
                ))
                if messages:
                    return messages
            if time.monotonic() >= deadline:
                return []

    def ack(self, messages: Sequence[Message]) -> None:
        """STANDARD: ``+ACK`` each, the last as a request: returns once the server applied them all."""
        self._reply([(self._receipt(m), ACK) for m in messages], "ack")

    def nack(self, message: Message, delay: float) -> None:
        """REDELIVERED: ``-NAK`` with the delay; JetStream redelivers then and counts it."""
        if delay < 0:
            raise TransportError(f"nack delay {delay!r}: must be >= 0")
        self._reply([(self._receipt(message), _nak(delay))], "nack")
        log.info("transport.nack", group=self.group, topic=message.topic, offset=message.offset,
                 attempt=message.attempt, delay=delay)

    def dead_letter(self, message: Message, failure: Failure) -> None:
        """POISON: the message with its failure to the group's dead-letter stream, then ``+TERM``."""
        receipt = self._receipt(message)
        headers = {**message.headers, **one_line(failure_headers(failure, message)), ID_HEADER: message.id,
                   ORIGIN_TOPIC_HEADER: origin_topic(message)}
        if message.key is not None:
            headers[KEY_HEADER] = message.key
        check_nats_message(headers, len(message.payload), self._connection.client.max_payload)
        subject, stream = self._layout.dead_letter_subject(self.group), self._layout.dead_letter_stream(self.group)
        doing = f"dead letter for group {self.group!r}"
        try:
            self._connection.guarded(lambda: self._connection.js.publish(subject, message.payload, headers=headers),
                                     doing)
        except BackendUnavailableError as exc:
            if isinstance(exc.__cause__, NoStreamResponseError) and self._streams.missing(stream):
                raise self._gone(doing, "stream", stream) from exc
            raise
        self._reply([(receipt, TERM)], "term")
        log.info("transport.dead_letter", group=self.group, topic=message.topic, offset=message.offset,
                 attempt=message.attempt, error_type=failure.error_type)

    def in_progress(self, messages: Sequence[Message]) -> None:
        """``+WPI``: JetStream restarts each message's AckWait."""
        self._reply([(self._receipt(m), WPI) for m in messages], "in progress", settle=False)

    def pending(self) -> int:
        """Published messages not yet handed out plus handed out and not acked, per consumer."""
        total, doing = 0, f"pending of group {self.group!r}"
        for topic, pull in self._pulls:
            try:
                info = self._connection.guarded(pull.consumer_info, doing)
            except TransportError as exc:
                # a pull on a deleted consumer waits in vain: this is where it shows
                if (what := deleted(exc)) is None:
                    raise
                self._streams.forget()
                raise self._gone(doing, what, self._layout.stream(topic)) from exc
            total += info.num_pending + info.num_ack_pending
        return total

    def close(self) -> None:
        """Leave: what this member holds unacknowledged is nak'ed to the other members at once."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            held, self._open = list(self._open), set()
        try:
            if held:
                self._send([(receipt, _nak(0.0)) for receipt in held], "hand back")
            for _, pull in self._pulls:
                self._connection.guarded(pull.unsubscribe, "unsubscribe")
        except Exception as exc:  # leaving over a dead connection: the AckWait hands them back
            log.info("transport.close_unclean", group=self.group, error=str(exc))

    # helpers

    def _accept(self, topic: str, records: list[Msg]) -> list[Message]:
        now = self._clock.time()
        delivered: list[Message] = []
        for record in records:
            headers = dict(record.headers or {})
            due = due_at(headers)
            if due > now:  # a delayed publish handed out early: wait inside JetStream until due
                self._send([(record.reply, _nak(due - now))], "defer")
                continue
            meta = record.metadata
            delivered.append(to_message(
                topic, meta.sequence.stream, record.data, headers, meta.num_delivered,
                meta.timestamp.timestamp(), record.reply,
            ))
        with self._lock:
            self._open.update(m.receipt for m in delivered if m.receipt)
        return delivered

    def _gone(self, doing: str, what: str, stream: str) -> BackendUnavailableError:
        """The outage that makes the worker join again, which creates the deleted ``what`` anew."""
        lost = "its messages are" if what == "stream" else "its place in the stream is"
        reread = "" if stream.startswith(self._layout.dead_letter_stream("")) else (
            ", and a consumer made anew reads the stream from its start (what was done is skipped by its token)")
        return BackendUnavailableError(
            f"nats: {doing}: the {what} was deleted from JetStream (stream {stream!r}; {lost} gone with "
            f"it): the group joins again and creates it anew{reread}")

    def _receipt(self, message: Message) -> str:
        receipt = message.receipt or ""
        if not receipt.startswith("$JS.ACK."):
            raise TransportError(
                f"message {message.id!r} has no nats:// receipt {receipt!r}: "
                "acknowledge messages fetched from this transport"
            )
        return receipt

    def _reply(self, replies: list[tuple[str, bytes]], doing: str, settle: bool = True) -> None:
        self._check_open()
        self._send(replies, doing)
        if settle:
            with self._lock:
                self._open.difference_update(receipt for receipt, _ in replies)

    def _send(self, replies: list[tuple[str, bytes]], doing: str) -> None:
        if not replies:
            return
        client = self._connection.client

        async def send() -> None:
            # JetStream answers an ack sent as a request once it has applied it, and applies one
            # connection's acks in order: the last one's answer confirms them all
            *first, (last_receipt, last_body) = replies
            for receipt, body in first:
                await client.publish(receipt, body)
            await client.request(last_receipt, last_body, timeout=self._connection.request_timeout)

        self._connection.guarded(send, f"{doing} for group {self.group!r}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"subscription of group {self.group!r} is closed")


async def _fetch(pull: JetStreamContext.PullSubscription, batch: int, wait: float) -> list[Msg]:
    """Up to ``batch`` messages; none when the pull expired empty (nats-py raises a timeout for it)."""
    try:
        return await pull.fetch(batch, timeout=wait)
    except (TimeoutError, nats.errors.TimeoutError):
        return []


def _nak(delay: float) -> bytes:
    if delay <= 0:
        return b"-NAK"
    return b"-NAK " + json.dumps({"delay": int(delay * 1_000_000_000)}).encode()


__all__ = ["INTERNAL_HEADERS", "NatsSubscription"]
