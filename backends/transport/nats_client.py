"""The nats-py side of `nats://`: the URL, one event loop thread, one connection, errors.

nats-py is asyncio. The transport owns one event loop on a background thread
and one connection on it; the worker's threads call in through
`asyncio.run_coroutine_threadsafe` (`Connection.call`). nats-py reconnects by
itself; what reaches the framework is an operation that could not finish
while the server was unreachable, or while a JetStream cluster had no leader
for the stream or consumer (an election: no responders, a 503, "JetStream
system temporarily unavailable"): a `BackendUnavailableError` (the worker
backs off and subscribes again; a producer retries). Any other failure is a
`TransportError`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.protocol.parser import AUTHORIZATION_VIOLATION

from backends.errors import (
    BackendUnavailableError,
    ConfigurationError,
    ReliableError,
    TransportError,
)
from backends.refusal import FirstContact
from backends.urls import redact

log = structlog.get_logger(__name__)
T = TypeVar("T")

_UNREACHABLE: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.NoServersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,  # a publish nobody answered: the stream has no leader
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)


@dataclass(frozen=True)
class Servers:
    """The servers of a ``nats://host:port[,host:port]`` URL (credentials in the URL are kept)."""

    url: str
    servers: list[str]

    @classmethod
    def parse(cls, url: str) -> Servers:
        scheme, separator, rest = url.partition("://")
        location = rest.partition("?")[0].rstrip("/")
        if scheme != "nats" or not separator or not location:
            raise ConfigurationError(f"transport URL {url!r}: expected nats://host:port[,host:port...]")
        servers = []
        for server in location.split(","):
            host, colon, port = server.rpartition("@")[2].rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigurationError(f"transport URL {url!r}: server {server!r} is not host:port")
            servers.append(f"nats://{server}")
        return cls(url, servers)


LEADERLESS = frozenset({10008, 10009})
"""JetStream error codes of a cluster without a leader for the request: "JetStream system
temporarily unavailable" (JSClusterNotAvailErr) and "JetStream cluster can not handle
request" (JSClusterNotLeaderErr); both pass once an election is over."""


def translate(exc: BaseException, doing: str) -> ReliableError:
    """Our error for a nats-py exception met while ``doing`` something."""
    text = f"nats: {doing}: {type(exc).__name__}: {exc}"
    if is_outage(exc):
        return BackendUnavailableError(text)
    return TransportError(text)


def refused_login(exc: BaseException) -> bool:
    """True for the server refusing the URL's credentials (none given, or wrong). The NATS protocol
    has no error codes, only the server's words ("Authorization Violation"), which nats-py itself
    matches the same way once connected (`nats.errors.AuthorizationError`)."""
    return isinstance(exc, nats.errors.AuthorizationError) or AUTHORIZATION_VIOLATION in str(exc).lower()


def is_outage(exc: BaseException) -> bool:
    """True for a server out of reach or a cluster in an election: the same call succeeds later."""
    if isinstance(exc, _UNREACHABLE):
        return True
    return isinstance(exc, nats.js.errors.APIError) and (exc.code == 503 or exc.err_code in LEADERLESS)


class Connection:
    """One nats-py connection on its own event loop thread."""

    def __init__(self, servers: Servers, request_timeout: float) -> None:
        self.request_timeout = request_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nats-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._contact = FirstContact("[transport] url", redact(servers.url))
        self._refusal: Exception | None = None  # the server's refusal of the credentials, until reconnected
        try:
            self.client: Client = self.call(self._connect(servers), "connect")
        except ReliableError as exc:
            self._stop()
            if self._refusal is not None:
                raise self._contact.refused(f"connect: {self._refusal}", BackendUnavailableError) from exc
            raise
        self._contact.accepted()
        self.js: JetStreamContext = self.client.jetstream(timeout=request_timeout)

    async def _connect(self, servers: Servers) -> Client:
        """Connect, trying each server twice; once connected, reconnect forever.

        nats-py reads ``max_reconnect_attempts`` from its options at each
        reconnect, so a first connection fails fast (a `BackendUnavailableError`
        the worker backs off from) while a connection once made is never given up.
        """
        client = await nats.connect(
            servers=servers.servers,
            connect_timeout=self.request_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.5,
            ping_interval=5,
            max_outstanding_pings=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        client.options["max_reconnect_attempts"] = -1
        return client

    @property
    def reconnects(self) -> int:
        """How many times nats-py reconnected this connection."""
        return int(self.client.stats["reconnects"])

    @property
    def connected(self) -> bool:
        return bool(self.client.is_connected)

    def call(self, coroutine: Coroutine[Any, Any, T], doing: str, timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for it; errors translated."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout if timeout is not None else self.request_timeout * 2 + 5)
        except ReliableError:
            raise
        except Exception as exc:
            future.cancel()
            raise translate(exc, doing) from exc

    def guarded(self, make: Callable[[], Awaitable[T]], doing: str, timeout: float | None = None) -> T:
        """``make()`` on the loop, refused at once while the connection is down."""
        if not self.connected:
            if self._refusal is not None:  # it worked before: waited out, logged as a refusal
                raise self._contact.refused(f"{doing}: {self._refusal}", BackendUnavailableError)
            raise BackendUnavailableError(f"nats: {doing}: not connected (reconnecting)")

        async def run() -> T:
            return await make()

        return self.call(run(), doing, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.call(self.client.close(), "close", timeout=self.request_timeout)
        except ReliableError as exc:
            log.warning("transport.close_failed", error=str(exc))
        self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _on_error(self, exc: Exception) -> None:
        if refused_login(exc):
            self._refusal = exc
        log.warning("transport.nats_error", error=f"{type(exc).__name__}: {exc}")

    async def _on_disconnected(self) -> None:
        if not self._closed:  # nats-py reports its own close as a disconnection too
            log.warning("transport.disconnected")

    async def _on_reconnected(self) -> None:
        self._refusal = None
        log.info("transport.reconnected")
