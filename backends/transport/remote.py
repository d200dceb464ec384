"""``reliable://[user:password@]host:port``: the broker server, through its native protocol.

The same `BrokerTransport` as ``embedded://``, over `broker.client.Client`
instead of the engine in process: services on several machines share one
broker. Options: ``visibility_timeout`` (the lease of a delivered message),
``publish_retry`` (seconds a publish goes on reconnecting and resending the
same batch id, which the server's de-duplication makes safe, before it
raises `BackendUnavailableError` to its caller's own retry: the app's
``[transport] publish_timeout``, the relay's backoff; default 30) and
``queues`` (ignored here: the server's settings decide a new topic's queues).
A publish given a ``timeout`` (``App.publish``'s last try) makes its connect,
hello and replies within it, resends included.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import ConfigurationError
from backends.refusal import FirstContact
from backends.transport.broker import BrokerTransport
from backends.urls import redact
from broker.client import Client
from broker.delivery.values import OutgoingMessage as BrokerMessage
from broker.errors import BrokerError


class RemoteBrokerTransport(BrokerTransport):
    """The broker server at ``url``."""

    def __init__(self, url: str, clock: Clock = SYSTEM_CLOCK, *, visibility_timeout: float = 30.0,
                 publish_retry: float = 30.0, queues: int | None = None) -> None:
        parts = urlsplit(url)
        if not publish_retry >= 0:
            raise ConfigurationError(f"transport {url!r}: publish_retry={publish_retry!r}: must be >= 0 seconds")
        try:
            client = Client(f"{parts.hostname}:{parts.port}",
                            user=unquote(parts.username) if parts.username else None,
                            password=unquote(parts.password) if parts.password else None,
                            publish_retry_seconds=publish_retry)
        except (BrokerError, ValueError) as exc:
            raise ConfigurationError(f"transport {url!r}: expected reliable://host:port ({exc})") from exc
        super().__init__(client, clock, visibility_timeout=visibility_timeout)
        self.client = client
        self.contact = FirstContact("[transport] url", redact(url))

    def _publish(self, topic: str, messages: list[BrokerMessage], timeout: float | None) -> None:
        """Over the network: the connect, hello and replies within ``timeout`` where given."""
        self.client.publish(topic, messages, timeout=timeout)
