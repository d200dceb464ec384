"""One native-protocol connection: frames in, requests dispatched by id, replies out.

Requests run in the order they arrive, except long waits (``fetch``), which
run beside the others, so one connection pipelines many requests and reads
replies by id. Until a ``hello`` with good credentials, a server with users
answers every request with ``unauthenticated``; a wrong password, or no hello
within ``handshake_timeout``, closes the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from broker.errors import BrokerError
from broker.server import native_admin, native_codec, native_ops
from broker.server.auth import Authenticator, Principal
from broker.server.connection import Connection, ConnectionTimedOut
from broker.server.engine import Engine
from broker.server.errors import (
    AuthenticationError,
    MalformedFrameError,
    ProtocolError,
    ServerError,
    UnknownOperationError,
)
from broker.server.native_codec import FrameDecoder, decode_body

SERVER_NAME = "reliable-broker"


class NativeSession:
    """Serves one connection until the client leaves, breaks the protocol or times out."""

    def __init__(self, conn: Connection, engine: Engine, authenticator: Authenticator) -> None:
        self.conn = conn
        self.engine = engine
        self.authenticator = authenticator
        self.ctx: native_ops.Context | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        decoder = FrameDecoder(self.conn.limits.max_frame_size)
        loop = asyncio.get_running_loop()
        handshake_ends = loop.time() + self.conn.limits.handshake_timeout
        try:
            while True:
                waiting = self.ctx is None and self.authenticator.required
                try:
                    data = await self.conn.read(handshake_ends - loop.time() if waiting else None)
                except ConnectionTimedOut:
                    if self._tasks:  # a client waiting for a long fetch is not idle
                        continue
                    raise
                if not data:
                    return
                for payload in decoder.feed(data):
                    await self._handle(payload)
        except ProtocolError as error:
            await self._reply_error(0, error, fatal=True)
        except ConnectionTimedOut as timeout:
            if timeout.reason != "slow_client":  # a slow client is counted where it is cut off
                self.conn.metrics.timeouts.labels("native", timeout.reason).inc()
                self.conn.log.info("connection_timed_out", reason=timeout.reason)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await self._end()

    async def _handle(self, payload: bytes) -> None:
        request_id = 0
        try:
            request = decode_body(payload)
            request_id = native_ops.need(request, "request", "id", int)
            op = native_ops.need(request, "request", "op", str)
            self.conn.metrics.frames.labels("native", op if op in _KNOWN else "unknown").inc()
            if op == "hello":
                await self._hello(request_id, request)
                return
            ctx = self._context()
            operation = OPERATIONS.get(op)
            if operation is None:
                raise UnknownOperationError(f"unknown operation {op[:40]!r}; known: {sorted(_KNOWN)}")
        except ServerError as error:
            if await self._reply_error(request_id, error):
                raise _Close from error
            return
        if op in CONCURRENT:
            task = asyncio.create_task(self._run(request_id, operation, ctx, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            await self._run(request_id, operation, ctx, request)

    def _context(self) -> native_ops.Context:
        if self.ctx is None:
            if self.authenticator.required:
                raise AuthenticationError("send hello with credentials first")
            self.ctx = self._new_context(self.authenticator.authenticate(None, None))
        return self.ctx

    def _new_context(self, principal: Principal) -> native_ops.Context:
        return native_ops.Context(self.engine, principal, self.conn.metrics,
                                  self.conn.limits.max_fetch_wait)

    async def _hello(self, request_id: int, request: Mapping[str, Any]) -> None:
        if self.ctx is not None:
            raise MalformedFrameError("hello: this connection has already said hello")
        user = native_ops.need(request, "hello", "user", str, None)
        password = native_ops.need(request, "hello", "password", str, None)
        try:
            principal = await asyncio.to_thread(self.authenticator.authenticate, user, password)
        except AuthenticationError as error:
            self.conn.metrics.auth_failures.labels("native").inc()
            self.conn.log.warning("authentication_failed", user=user)
            await self._reply_error(request_id, error, fatal=True)
            raise _Close from error
        self.ctx = self._new_context(principal)
        await self._send({"id": request_id, "ok": True, "server": SERVER_NAME,
                          "protocol": native_codec.VERSION, "user": principal.name,
                          "max_frame_size": self.conn.limits.max_frame_size})

    async def _run(self, request_id: int, operation: native_ops.Operation,
                   ctx: native_ops.Context, request: Mapping[str, Any]) -> None:
        try:
            reply = await operation(ctx, request)
        except BrokerError as error:
            await self._reply_error(request_id, error)
        except Exception as error:  # the engine's bug must not end the server
            self.conn.log.exception("request_failed", op=request.get("op"))
            await self._reply_error(request_id, error)
        else:
            try:
                await self._send({"id": request_id, "ok": True, **reply})
            except (ConnectionError, ConnectionTimedOut):
                self.conn.abort()

    async def _reply_error(self, request_id: int, error: Exception, fatal: bool = False) -> bool:
        """Report ``error`` for ``request_id``; whether the connection must now close."""
        code = _code(error)
        fatal = fatal or getattr(error, "fatal", False)
        self.conn.metrics.errors.labels("native", code).inc()
        try:
            await self._send({"id": request_id, "ok": False, "fatal": fatal,
                              "error": {"code": code, "type": type(error).__name__,
                                        "message": str(error)}})
        except (ConnectionError, ConnectionTimedOut):
            self.conn.abort()
            return True
        return fatal

    async def _send(self, body: Mapping[str, Any]) -> None:
        await self.conn.send(native_codec.encode(body))

    async def _end(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for member in list(self.ctx.members if self.ctx else ()):
            try:
                await self.engine.leave(member)
            except Exception:
                self.conn.log.exception("leave_failed", member=member)
        await self.conn.close()


class _Close(ConnectionError):
    """Internal: a fatal error was reported; the connection ends."""


OPERATIONS = {**native_ops.OPERATIONS, **native_admin.OPERATIONS}
CONCURRENT = native_ops.CONCURRENT | native_admin.CONCURRENT
_KNOWN = frozenset(OPERATIONS) | {"hello"}


def _code(error: Exception) -> str:
    if isinstance(error, ServerError):
        return error.code
    if isinstance(error, BrokerError):
        return "broker_error"
    return "internal_error"
