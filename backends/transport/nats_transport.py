"""`nats://host:port[,host:port]`: NATS JetStream through nats-py.

Each topic is a stream (limits retention: every group reads every message);
each group has durable pull consumers per topic whose work its members share
(`nats_layout`). JetStream does the rest natively:

* ``attempt`` is JetStream's delivery count (``num_delivered``);
* a fetched message stays with its member for AckWait (the ``lease``, or the
  transport's ``visibility_timeout``), restarted by ``in_progress`` (``+WPI``);
* ``nack(delay)`` is ``-NAK`` with the delay: redelivered then, counted;
* ``dead_letter`` publishes the message with its failure to the group's
  dead-letter stream (waiting for the stream's ack), then ``+TERM``;
* ``publish`` sets ``Nats-Msg-Id`` to the message id (de-duplicated within the
  stream's duplicate window); ``publish_to_group`` goes to the group's subject;
* ``pending`` is the consumers' ``num_pending + num_ack_pending``.

MaxDeliver is unlimited: the framework's redelivery policy decides when a
message is poison. A publish with ``delay`` carries its due time in a header:
a member handed it earlier naks it until then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

import structlog
from nats.js.errors import NoStreamResponseError

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import BackendUnavailableError, ConfigurationError
from backends.transport.base import SubscribeOptions, Transport, count, seconds, with_servers
from backends.transport.nats_client import Connection, Servers
from backends.transport.nats_layout import (
    CAPABILITIES,
    DUE_HEADER,
    ID_HEADER,
    KEY_HEADER,
    MSG_ID_HEADER,
    Layout,
    check_nats_message,
    check_nats_name,
)
from backends.transport.nats_streams import Streams
from backends.transport.nats_subscription import Durables, NatsSubscription
from backends.types import OutgoingMessage

log = structlog.get_logger(__name__)


class NatsTransport(Transport):
    """A `Transport` over NATS JetStream.

    Options: ``namespace`` (prefix of every stream and subject, default
    ``reliable``), ``visibility_timeout`` (AckWait in seconds, default 30),
    ``request_timeout`` (seconds a request may take before the server counts
    as unreachable, default 10), ``duplicate_window`` (seconds JetStream
    remembers a ``Nats-Msg-Id``, default 120), ``replicas`` (stream replicas
    on a cluster, default 1; an existing stream is updated to it), ``servers``
    (more ``host:port`` of the cluster besides the URL's).
    """

    capabilities = CAPABILITIES

    def __init__(
        self,
        url: str,
        clock: Clock = SYSTEM_CLOCK,
        *,
        namespace: str = "reliable",
        visibility_timeout: float | str = 30.0,
        request_timeout: float | str = 10.0,
        duplicate_window: float | str = 120.0,
        replicas: int | str = 1,
        servers: Sequence[str] | str = (),
    ) -> None:
        addresses = Servers.parse(with_servers(url, servers))
        self._layout = Layout(namespace)
        self._clock = clock
        self._ack_wait = seconds("visibility_timeout", visibility_timeout)
        self._duplicate_window = seconds("duplicate_window", duplicate_window)
        self._connection = Connection(addresses, seconds("request_timeout", request_timeout))
        self._streams = Streams(self._connection, replicas=_replicas(replicas), duplicate_window=self._duplicate_window)
        self._durables = Durables()
        self._subscriptions: list[NatsSubscription] = []

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        self._to_stream(topic, self._layout.subject(topic), messages, dedupe=True, timeout=timeout)

    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        """To the group's own subject; never de-duplicated (a replay repeats a published id)."""
        self._to_stream(topic, self._layout.group_subject(topic, group), messages, dedupe=False)

    def _to_stream(self, topic: str, subject: str, messages: Sequence[OutgoingMessage], *, dedupe: bool,
                   timeout: float | None = None) -> None:
        """Publish to the topic's stream; one deleted under us (nobody answers) is created again."""
        self.ensure_stream(topic)
        try:
            self._publish(subject, messages, dedupe=dedupe, timeout=timeout)
        except BackendUnavailableError as exc:
            stream = self._layout.stream(topic)
            if not isinstance(exc.__cause__, NoStreamResponseError) or not self._streams.missing(stream):
                raise  # a cluster electing a leader: an outage
            log.warning("transport.stream_deleted", stream=stream, then="created again")
            self.ensure_stream(topic)
            self._publish(subject, messages, dedupe=dedupe, timeout=timeout)

    def subscribe(
        self, group: str, topics: Sequence[str], options: SubscribeOptions | None = None
    ) -> NatsSubscription:
        self._check_open()
        self._check_names(group=group)
        self.ensure_dead_letter_stream(group)
        subscription = NatsSubscription(
            group, topics, options or SubscribeOptions(), connection=self._connection, layout=self._layout,
            ensure_stream=self.ensure_stream, streams=self._streams, durables=self._durables, ack_wait=self._ack_wait,
            clock=self._clock,
        )
        self._subscriptions.append(subscription)
        return subscription

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for subscription in self._subscriptions:
            subscription.close()
        self._connection.close()

    @property
    def connected(self) -> bool:
        return self._connection.connected

    @property
    def reconnects(self) -> int:
        """How many times the connection was lost and made again."""
        return self._connection.reconnects

    def purge(self) -> None:
        """Delete every stream of this namespace (tests' clean-up)."""
        prefix = f"{self._layout.namespace}_"
        js = self._connection.js

        async def delete() -> None:
            for name in await js.streams_info():
                if name.config.name and name.config.name.startswith(prefix):
                    await js.delete_stream(name.config.name)

        self._connection.guarded(delete, "purge")
        self._streams.forget()

    def ensure_stream(self, topic: str) -> None:
        """The topic's stream, created or reconciled on first use (file storage, limits retention)."""
        self._streams.ensure(self._layout.stream(topic), self._layout.stream_subjects(topic))

    def ensure_dead_letter_stream(self, group: str) -> None:
        self._streams.ensure(self._layout.dead_letter_stream(group), [self._layout.dead_letter_subject(group)])

    def _publish(self, subject: str, messages: Sequence[OutgoingMessage], *, dedupe: bool,
                 timeout: float | None = None) -> None:
        now = self._clock.time()
        js = self._connection.js
        prepared = []
        for message in messages:
            headers = {**message.headers, ID_HEADER: cast(str, message.message_id)}
            if message.key is not None:
                headers[KEY_HEADER] = message.key
            if message.delay > 0:
                headers[DUE_HEADER] = repr(now + message.delay)
            if dedupe:
                headers[MSG_ID_HEADER] = headers[ID_HEADER]
            check_nats_message(headers, len(message.payload), self._connection.client.max_payload)
            prepared.append((message.payload, headers))

        waited = self._connection.request_timeout if timeout is None else min(timeout, self._connection.request_timeout)

        async def send() -> None:
            # every publish in flight together, then every stream ack awaited
            acks = [await js.publish_async(subject, payload, headers=headers) for payload, headers in prepared]
            await asyncio.wait_for(asyncio.gather(*acks), waited)

        self._connection.guarded(send, f"publish to {subject!r}")

    def _check_name(self, kind: str, name: str) -> None:
        check_nats_name(kind, name)



def _replicas(value: int | str) -> int:
    """A JetStream stream has 1 to 5 replicas."""
    number = count("replicas", value)
    if number > 5:
        raise ConfigurationError(f"transport option replicas={value!r} is not allowed; expected an integer from 1 to 5")
    return number
