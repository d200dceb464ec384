"""Publishing with a window of publisher confirms in flight: pika's asynchronous connection on a thread of its own.

pika's `BlockingChannel` waits for each confirm before the next publish
(about 7x slower than a transaction per batch, ``benchmarks/amqp_clients.py``),
and has no public way to keep several in flight. A `Publisher` runs a pika
`SelectConnection` on an I/O loop thread: a batch is published at once on a
channel in confirm mode, and the caller waits until RabbitMQ has settled
every delivery tag of it (an ack of several tags at once included).

The guarantee is the one of confirming each: a batch counts as sent only
once RabbitMQ acked every message of it. A nack (RabbitMQ could not enqueue
one, for example while a quorum queue elects a leader) or a connection lost
before the last ack raises `BackendUnavailableError`, and the caller
publishes the whole batch again (its messages keep their ids); a returned
message (``mandatory``, no queue bound) raises `TransportError`. A nack
or any failure closes the publisher; its owner opens a new one.

A connection RabbitMQ blocks (a memory or disk alarm) fails its batch after
`BLOCKED_GRACE` with `WritesRefusedError` naming the alarm, so the caller's
own bound holds, and stays open: RabbitMQ read the publish that made it block
(it enqueues it, and confirms it once the alarm clears), and every batch until
``connection.unblocked`` is refused at once without being sent. A caller that
retries through the alarm sends nothing more into a broker short of memory or
disk, where a new connection per retry had each retry enqueued (six
duplicates in 8 s). pika still closes a connection blocked for 3 x
``connect_timeout``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

import pika
import structlog
from pika import spec
from pika.adapters.select_connection import IOLoop
from pika.adapters.utils.connection_workflow import AMQPConnectionWorkflowFailed
from pika.channel import Channel
from pika.frame import Method

from backends.errors import BackendUnavailableError, ReliableError, WritesRefusedError
from backends.refusal import FirstContact
from backends.transport.amqp_client import (
    FAILURES,
    Blocked,
    Publish,
    check_frames,
    not_connected,
    translate,
    unroutable,
)

log = structlog.get_logger(__name__)

BLOCKED_GRACE = 1.0
"""Seconds a batch waits on a connection RabbitMQ blocked (a memory or disk alarm) before it
fails naming the alarm, not pika's blocked-connection timeout (3 x ``connect_timeout``, 30 s
by default): a caller's own bound (``publish_timeout``) must hold."""

_CLOSED_BY_US = (pika.exceptions.ConnectionClosedByClient, pika.exceptions.ChannelClosedByClient)


class Confirms:
    """One batch's delivery tags RabbitMQ has not settled yet, and what it answered for the others.

    Written on the I/O loop thread only; the caller reads it once `done` is set.
    """

    def __init__(self, doing: str) -> None:
        self.doing = doing
        self.done = threading.Event()
        self._unsettled: set[int] = set()
        self._nacked = 0
        self._returned: list[str] = []
        self._failure: ReliableError | None = None

    def expect(self, tag: int) -> None:
        self._unsettled.add(tag)

    def published(self) -> None:
        """Every message of the batch is out: done already if there were none."""
        if not self._unsettled:
            self.done.set()

    def settle(self, tag: int, multiple: bool, acked: bool) -> None:
        settled = {t for t in self._unsettled if t <= tag} if multiple else self._unsettled & {tag}
        self._unsettled -= settled
        self._nacked += 0 if acked else len(settled)
        if not self._unsettled:
            self.done.set()

    def returned(self, to: str) -> None:
        """RabbitMQ gave a message back (it comes before that message's ack)."""
        self._returned.append(to)

    def fail(self, exc: BaseException, blocked: str | None = None) -> None:
        if not self.done.is_set():
            self._failure = translate(exc, self.doing, blocked)
            self.done.set()

    def check(self) -> None:
        """Raise if any message of the batch does not count as sent."""
        if self._failure is not None:
            raise self._failure
        if self._returned:
            raise unroutable(self.doing, self._returned)
        if self._nacked:
            raise BackendUnavailableError(
                f"amqp: {self.doing}: RabbitMQ refused {self._nacked} message(s) (negative confirm): publish again"
            )


class Publisher:
    """One connection that publishes confirmed batches, a batch at a time, from any thread."""

    def __init__(self, params: Sequence[pika.URLParameters], name: str, contact: FirstContact) -> None:
        self.name = name
        self._lock = threading.Lock()  # one batch in flight
        self._state = threading.Lock()  # the batch and the failure, shared with the I/O loop thread
        self._ready = threading.Event()
        self._confirms: Confirms | None = None
        self._failure: BaseException | None = None
        self._connection: pika.SelectConnection | None = None
        self._channel: Channel | None = None
        self._next_tag = 1
        self._blocked = Blocked(name)
        self._ioloop = IOLoop()
        self._thread = threading.Thread(target=self._run, args=(params,), name=f"amqp-{name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(sum(p.stack_timeout for p in params)):
            self.close()
        if self._failure is not None:
            raise not_connected(self._failure, f"connect ({name})", contact)
        contact.accepted()

    @property
    def open(self) -> bool:
        return self._failure is None

    def publish(self, messages: Sequence[Publish], doing: str, timeout: float | None = None) -> None:
        """Publish ``messages`` and wait until RabbitMQ acked every one (see the module's errors);
        not acked within ``timeout`` seconds (where given): `WritesRefusedError` naming the alarm
        on a blocked connection (kept), else the connection is closed (the next batch opens
        another) and `BackendUnavailableError` raised."""
        if not messages:
            return
        confirms = Confirms(doing)
        with self._lock:
            with self._state:
                if self._failure is not None or self._connection is None:
                    raise BackendUnavailableError(f"amqp: {doing}: the connection ({self.name}) is closed")
                if self._blocked.reason is not None:  # nothing more into a broker short of memory or disk
                    raise translate(pika.exceptions.ConnectionBlockedTimeout(), doing, self._blocked.reason)
                check_frames(messages, self._connection.params.frame_max, doing)  # negotiated at connect
                self._confirms = confirms
                self._ioloop.add_callback_threadsafe(partial(self._publish, messages, confirms))
            if not confirms.done.wait(timeout):
                blocked = self._blocked.reason
                if blocked is not None:  # as `_refuse_blocked` says, a little earlier: the connection stays
                    raise translate(pika.exceptions.ConnectionBlockedTimeout(), doing, blocked)
                self.close()  # its confirms would settle no batch of ours
                raise BackendUnavailableError(f"amqp: {doing}: not confirmed within {timeout:.3g} s")
        try:
            confirms.check()
        except WritesRefusedError:
            raise  # blocked: the connection stays, the next batch waits for it to be unblocked
        except BackendUnavailableError:
            # RabbitMQ 3.10 went on nacking every publish on a channel whose quorum queue had lost its
            # leader (30 s in the cluster test): the next batch goes through a new connection
            self.close()
            raise

    def close(self) -> None:
        with self._state:
            if self._failure is None:
                self._ioloop.add_callback_threadsafe(self._close)
        self._thread.join()

    # the I/O loop thread

    def _run(self, params: Sequence[pika.URLParameters]) -> None:
        pika.SelectConnection.create_connection(params, self._on_connected, custom_ioloop=self._ioloop)
        try:
            self._ioloop.start()
        finally:
            self._fail(BackendUnavailableError(f"the connection ({self.name}) is closed"))
            with self._state:
                self._ioloop.close()

    def _on_connected(self, result: pika.connection.Connection | BaseException) -> None:
        if isinstance(result, BaseException):
            self._fail(result.exceptions[-1] if isinstance(result, AMQPConnectionWorkflowFailed) else result)
            self._ioloop.stop()
            return
        self._connection = result
        result.add_on_close_callback(self._on_connection_closed)
        result.add_on_connection_blocked_callback(self._on_blocked)
        result.add_on_connection_unblocked_callback(self._blocked.on_unblocked)
        result.channel(on_open_callback=self._on_channel)

    def _on_channel(self, channel: Channel) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(self._on_confirm, callback=lambda _: self._ready.set())

    def _publish(self, messages: Sequence[Publish], confirms: Confirms) -> None:
        if self._channel is None:
            return  # not open: _fail has failed the batch
        try:
            for message in messages:
                self._channel.basic_publish(
                    message.exchange, message.routing_key, message.body, message.properties, mandatory=True
                )
                confirms.expect(self._next_tag)
                self._next_tag += 1
        except FAILURES as exc:
            self._fail(exc)
            self._close()
        confirms.published()

    def _on_confirm(self, frame: Method) -> None:
        if self._confirms is not None:
            ack = frame.method
            self._confirms.settle(ack.delivery_tag, ack.multiple, isinstance(ack, spec.Basic.Ack))

    def _on_return(self, _channel: Channel, method: spec.Basic.Return, *_: object) -> None:
        if self._confirms is not None:
            self._confirms.returned(method.exchange or method.routing_key)

    def _on_blocked(self, connection: pika.connection.Connection, frame: Method) -> None:
        self._blocked.on_blocked(connection, frame)
        self._ioloop.call_later(BLOCKED_GRACE, self._refuse_blocked)

    def _refuse_blocked(self) -> None:
        """The batch in flight fails naming the alarm if RabbitMQ still blocks the connection."""
        if self._blocked.reason is not None and self._confirms is not None:
            self._confirms.fail(pika.exceptions.ConnectionBlockedTimeout(), self._blocked.reason)

    def _on_channel_closed(self, _channel: Channel, reason: BaseException) -> None:
        self._fail(reason)  # a channel RabbitMQ closed (a 404): the connection goes with it
        self._close()

    def _on_connection_closed(self, _connection: pika.connection.Connection, reason: BaseException) -> None:
        self._fail(reason)
        self._ioloop.stop()

    def _close(self) -> None:
        if self._connection is None or self._connection.is_closed:
            self._ioloop.stop()  # not connected (yet): nothing to close
        elif not self._connection.is_closing:
            self._connection.close()  # _on_connection_closed stops the loop

    def _fail(self, exc: BaseException) -> None:
        """The publisher is done: the batch in flight fails with ``exc``, later ones are refused."""
        with self._state:
            if self._failure is None:
                self._failure = exc
                if self._ready.is_set() and not isinstance(exc, _CLOSED_BY_US):
                    blocked = isinstance(exc, pika.exceptions.ConnectionBlockedTimeout)
                    error = str(translate(exc, "publish", self._blocked.reason) if blocked else exc)
                    log.warning("transport.disconnected", connection=self.name, error=error)
            confirms = self._confirms
        if confirms is not None:
            confirms.fail(exc, self._blocked.reason)
        self._ready.set()
