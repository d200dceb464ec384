"""What one HTTP client can hold of the console's listener, and for how long.

The console serves from the process of the broker server (or of ``reliable
console``, beside the app's store and transport connections), so each
connection it holds is a file descriptor that process's store and clients
need too. uvicorn (0.54) bounds none of it: its h11 protocol starts no timer
until it has sent a response, and any byte cancels that one, so a socket that
sends nothing, or half a request a byte at a time, is held for ever; nothing
caps the connections. (``limit_concurrency`` answers 503 to requests past it
and counts idle sockets among them: it would give the console to the silent
sockets rather than keep them out.) So each connection is:

* admitted when accepted, before a byte is read, by the broker's own
  `Admission`: ``max_connections`` in all, ``max_connections_per_address``
  from one peer (an IPv6 one as its /64), any number up to the cap in all
  from one of ``trusted_proxies`` (every client behind it shares its
  address); the others are closed unread, counted in
  ``broker_connections_refused_total{listener="console"}`` (the broker
  server's metrics, or those of ``reliable console --metrics-port``) and
  logged once a minute per address, naming the ``console_*`` setting;
* given ``request_timeout`` seconds to send its request, head and body, from
  the accept and, on a kept-alive connection, from the end of the previous
  response; and as long to take a response once the socket's buffers are
  full (a client that pipelines requests and reads nothing held the
  connection for ever: the response waited for room). Past them it is closed.

A request's head is bounded by `SizeLimits` (`MAX_HEAD`: 431 past it; h11
answers 400 only to an unfinished head past it, so a whole head of 100 KiB
arriving in one read was served), its body too (`MAX_BODY`: 413).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from broker.console.config import ConsoleConfig
from broker.server.admission import Admission, CapNames, Refusals
from broker.server.config import Limits
from broker.store.clock import SYSTEM_CLOCK, Clock

MAX_HEAD = 16 * 1024
"""Bytes of a request line and headers (h11's own bound on an unfinished head, pinned here)."""
MAX_BODY = 1024 * 1024
"""Bytes of a request body: the largest form (replaying a page of 1000 letters) is a few dozen KiB."""
WAITING = (h11.IDLE, h11.SEND_BODY)
"""The client's h11 states in which the connection waits for it to send a request."""


CONSOLE_CAPS = CapNames("the console", "console_max_connections", "console_max_connections_per_address",
                        "if it is a proxy, list it in console_trusted_proxies")
"""What the console's refusals name: its own settings, not the broker's."""


def protocol_for(config: ConsoleConfig, metrics: Refusals, clock: Clock = SYSTEM_CLOCK) -> type[H11Protocol]:
    """The protocol class uvicorn serves the console with: `Guarded`, admitting by ``config``'s caps
    and counting its refusals in ``metrics``."""
    proxies = {proxy: config.max_connections for proxy in config.trusted_proxies}
    limits = Limits(max_connections=config.max_connections,
                    max_connections_per_address=config.max_connections_per_address,
                    max_connections_per_address_overrides=proxies)
    admission = Admission(limits, metrics, clock, CONSOLE_CAPS)
    return type("Guarded", (Guarded,), {"admission": admission, "request_timeout": config.request_timeout})


class Guarded(H11Protocol):
    """uvicorn's h11 protocol, for an admitted connection only, with a deadline on each request and
    on each response stalled by a client that does not read."""

    admission: ClassVar[Admission]
    request_timeout: ClassVar[float]
    admitted = False
    peer: str | None = None
    waiting: asyncio.TimerHandle | None = None  # for the client's request
    stalled: asyncio.TimerHandle | None = None  # for the client to take what it was sent

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        if self.admission.admit("console", self.peer) is not None:
            transport.abort()
            return
        self.admitted = True
        super().connection_made(transport)
        self.waiting = self._deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self.admission.release(self.peer)
        _cancel(self.waiting)
        _cancel(self.stalled)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in WAITING:
            _cancel(self.waiting)
            self.waiting = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state in WAITING or self.transport.is_closing():
            _cancel(self.waiting)  # the next request; or, closing, for the client to take this response
            self.waiting = self._deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.stalled = self.stalled or self._deadline()

    def resume_writing(self) -> None:
        super().resume_writing()
        _cancel(self.stalled)
        self.stalled = None

    def _deadline(self) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(self.request_timeout, self._too_late)

    def _too_late(self) -> None:
        self.transport.abort()  # not close(): that waits for a client that may never read


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


class _BodyTooLarge(Exception):
    """Raised when a request's body grows past `MAX_BODY` while the console reads it."""


class SizeLimits:
    """Answers 431 to a request whose head is over `MAX_HEAD` bytes, and 413 to one whose body is
    over `MAX_BODY` bytes, declared or sent chunked.

    Starlette reads a form whole before the handler sees it: up to 1000 fields
    of 1 MiB each in memory, and multipart files of any size spooled to disk
    (for the log-in form too, before any check).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _head_size(scope) > MAX_HEAD:
            await _refuse(send, 431, f"a request line and headers may have {MAX_HEAD} bytes\n")
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")  # h11 checked: digits
        if int(declared) > MAX_BODY:
            await _too_large(send)
            return
        received, started = 0, False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY:
                raise _BodyTooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _BodyTooLarge:
            if started:
                raise
            await _too_large(send)


def _head_size(scope: Scope) -> int:
    """The bytes of the request line and headers, as sent (but for spaces and the version)."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string", b""))
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


async def _too_large(send: Send) -> None:
    await _refuse(send, 413, f"a request body may have {MAX_BODY} bytes\n")


async def _refuse(send: Send, status: int, why: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": why.encode()})
