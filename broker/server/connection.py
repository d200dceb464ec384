"""One client connection as both protocols use it: timed reads, bounded writes, one close.

A read that sees nothing for ``idle_timeout`` seconds, or a write the client
does not take within ``slow_client_timeout`` seconds, ends the connection
(`ConnectionTimedOut`), so a silent or stalled client cannot hold a slot.
``handshake_ends`` is the loop time by which the client must be logged in:
``handshake_timeout`` from the accept, one budget for the TLS handshake (with
TLS) and the log-in together.
"""

from __future__ import annotations

import asyncio
import socket

import structlog

from broker.server.config import Limits
from broker.server.metrics import ServerMetrics

log = structlog.get_logger("broker.server")
READ_CHUNK = 64 * 1024
LINGER = 2.0
"""Seconds a connection reads on (and drops) after a fatal error, so the client reads the error."""
KEEPALIVE = {"TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 6}
"""TCP keepalive of every client connection: probes after 60 s of silence, every 10 s; six
unanswered and the kernel ends the connection. A peer that vanished without a FIN (a cut cable,
a host powered off) is found in about two minutes even when neither side has anything to send
(a STOMP subscriber without heart-beats, waiting for messages), as Kafka and RabbitMQ do."""


class ConnectionTimedOut(Exception):
    """Internal: the client was idle or too slow to read; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Connection:
    """The stream pair of one client with the server's limits applied."""

    def __init__(self, listener: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 limits: Limits, metrics: ServerMetrics) -> None:
        self.listener = listener
        self.limits = limits
        self.metrics = metrics
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()
        self._linger = False
        self.handshake_ends = asyncio.get_running_loop().time() + limits.handshake_timeout
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.host: str | None = peer[0] if isinstance(peer, tuple) else None  # None: a unix socket
        self.log = log.bind(listener=listener, peer=self.peer)
        if self.host is not None:
            _keepalive(writer.get_extra_info("socket"))

    async def read(self, timeout: float | None = None) -> bytes:
        """The next chunk from the client (``b""`` at end of stream)."""
        wait = self.limits.idle_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(wait):  # unlike wait_for, no task made per read
                return await self._reader.read(READ_CHUNK)
        except TimeoutError:
            raise ConnectionTimedOut("idle") from None

    async def send(self, data: bytes) -> None:
        """Write ``data``; a client that does not take it in time is cut off (and counted here)."""
        async with self._write_lock:
            self._writer.write(data)
            try:
                async with asyncio.timeout(self.limits.slow_client_timeout):
                    await self._writer.drain()
            except TimeoutError:
                self.metrics.timeouts.labels(self.listener, "slow_client").inc()
                self.log.info("connection_timed_out", reason="slow_client")
                self.abort()
                raise ConnectionTimedOut("slow_client") from None

    async def _drain_client(self) -> None:
        """Half-close, then drop what the client still sends until it closes its side, for `LINGER`
        seconds at most. Closed with its bytes unread, the kernel sends a reset instead of a FIN,
        and a reset can destroy the error frame before the client has read it."""
        try:
            if self._writer.can_write_eof():
                self._writer.write_eof()
            async with asyncio.timeout(LINGER):
                while await self._reader.read(READ_CHUNK):
                    pass
        except (OSError, TimeoutError):
            pass

    def abort(self) -> None:
        """Drop the connection now, without flushing (for a client that stopped reading)."""
        self._writer.transport.abort()

    def told_fatal(self) -> None:
        """The client was sent an error after which the connection ends: `close` lets it read it."""
        self._linger = True

    async def close(self) -> None:
        if self._writer.is_closing():
            return
        if self._linger:
            await self._drain_client()
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (OSError, TimeoutError):
            self.abort()


def _keepalive(sock: socket.socket | None) -> None:
    """Turn TCP keepalive on with `KEEPALIVE`'s timing (where the platform has the options)."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:  # the client is already gone
        pass
