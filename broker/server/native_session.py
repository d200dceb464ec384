"""One native-protocol connection: frames in, requests dispatched by id, replies out.

Requests run in the order they arrive, except long waits (``fetch``), which
run beside the others, so one connection pipelines many requests and reads
replies by id. The session reads ahead while a request runs (up to its
inbox's bound), and publishes to one topic (acks of one member) that queued up
meanwhile run as one engine call: one fsync covers them. A server with users
answers a request before a ``hello`` with good credentials ``unauthenticated``
and closes the connection, as it does on a wrong password or no hello within
``handshake_timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from broker.errors import BrokerError, disk_full
from broker.protocol import codec as native_codec
from broker.protocol.codec import FrameDecoder, decode_body
from broker.protocol.errors import (
    AuthenticationError,
    LockedOutError,
    MalformedFrameError,
    ProtocolError,
    RequestLimitError,
    ServerError,
    UnknownOperationError,
)
from broker.protocol.operations import OPERATIONS, Operation
from broker.server import native_ops, native_runs
from broker.server.auth import OPEN, Principal
from broker.server.connection import Connection, ConnectionTimedOut
from broker.server.engine import ByteWindow, Engine
from broker.server.guard import AuthGuard
from broker.server.inbox import Inbox, Pending
from broker.server.quota import GroupQuota, TopicQuota

SERVER_NAME = "reliable-broker"
INBOX_BYTES = 4 * 1024 * 1024
"""The frames a connection may have read ahead, in bytes (one frame more at most)."""


class NativeSession:
    """Serves one connection until the client leaves, breaks the protocol or times out."""

    def __init__(self, conn: Connection, engine: Engine, guard: AuthGuard, quota: GroupQuota,
                 topic_quota: TopicQuota) -> None:
        self.conn = conn
        self.engine = engine
        self.guard = guard
        self.quota, self.topic_quota = quota, topic_quota
        self.ctx: native_ops.Context | None = None
        self._inbox = Inbox(INBOX_BYTES)
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        reading = asyncio.create_task(self._read())
        serving = asyncio.create_task(self._serve())
        try:
            await asyncio.wait({reading, serving}, return_when=asyncio.FIRST_EXCEPTION)
            if reading.done() and isinstance(reading.exception(), ProtocolError):
                self._inbox.close()  # the requests before the broken frame still run
                await asyncio.wait({serving})
            for task in (serving, reading):
                if task.done():
                    task.result()
        except ProtocolError as error:
            await self._reply_error(0, error, fatal=True)
        except ConnectionTimedOut as timeout:
            if timeout.reason != "slow_client":  # a slow client is counted where it is cut off
                self.conn.metrics.timeouts.labels("native", timeout.reason).inc()
                self.conn.log.info("connection_timed_out", reason=timeout.reason)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for task in (reading, serving):
                task.cancel()
            await asyncio.gather(reading, serving, return_exceptions=True)
            await self._end()

    async def _read(self) -> None:
        """Frames into the inbox until the client closes its side (then the inbox closes).

        Until a hello passes, frames may be only ``max_handshake_frame_size`` bytes and nothing is
        read past a hello while it is checked: an unauthenticated client cannot make the server
        buffer ``max_frame_size``. What a client sent behind its hello is read once it passed."""
        limits = self.conn.limits
        decoder = FrameDecoder(limits.max_frame_size)
        if self.guard.required:
            decoder.max_frame_size = limits.handshake_frame_size
            decoder.limit_name = "max_handshake_frame_size"
        loop = asyncio.get_running_loop()
        handshake_ends = self.conn.handshake_ends  # from the accept: a TLS handshake spent part of it
        while True:
            waiting = self.ctx is None and self.guard.required
            try:
                data = await self.conn.read(handshake_ends - loop.time() if waiting else None)
            except ConnectionTimedOut:
                if self._tasks or not self._inbox.idle:  # a client waiting for a reply is not idle
                    if waiting:  # past the handshake's end: see whether its hello passes first
                        await self._inbox.settled()
                    continue
                if waiting:
                    raise ConnectionTimedOut("handshake") from None
                raise
            if not data:
                self._inbox.close()
                return
            read = [_pending(payload) for payload in decoder.feed(data, _is_hello if waiting else None)]
            for pending in read:
                self._inbox.put(pending)
            if waiting and read and read[-1].op == "hello":
                await self._authenticated(decoder)
            await self._inbox.room()

    async def _authenticated(self, decoder: FrameDecoder) -> None:
        """Wait for the hello read to be checked; if it passed, the frames that followed it, read
        with the full ``max_frame_size``."""
        await self._inbox.settled()
        if self.ctx is None:
            return  # refused: the connection is closing
        decoder.max_frame_size, decoder.limit_name = self.conn.limits.max_frame_size, "max_frame_size"
        for payload in decoder.feed(b""):
            self._inbox.put(_pending(payload))

    async def _serve(self) -> None:
        """Run the inbox's requests in order, until it closes."""
        while (pending := await self._inbox.take()) is not None:
            together = native_runs.TOGETHER.get(pending.op or "") if self.ctx is not None else None
            if together is None or together.key(pending.request) is None:
                await self._handle(pending)
                self._inbox.finished()
                continue
            run = [pending, *self._inbox.take_run(_joining(together, pending))]
            await self._run_together(together, run)
            self._inbox.finished(len(run))

    async def _handle(self, pending: Pending) -> None:
        request_id, request = pending.request_id, pending.request
        try:
            if pending.error is not None:
                raise pending.error
            op = native_ops.need(request, "request", "op", str)
            self.conn.metrics.frames.labels("native", op if op in _KNOWN else "unknown").inc()
            if op == "hello":
                await self._hello(request_id, request)
                return
            ctx = self._context()
            operation = OPERATIONS.get(op)
            if operation is None:
                raise UnknownOperationError(f"unknown operation {op[:40]!r}; known: {sorted(_KNOWN)}")
            if operation.waits:
                self._room_to_wait(op)
        except AuthenticationError as error:  # anything but hello first: closed, as Kafka does
            await self._reply_error(request_id, error, fatal=True)
            raise _Close from error
        except ServerError as error:
            if await self._reply_error(request_id, error):
                raise _Close from error
            return
        if operation.waits:  # a long wait runs beside the connection's other requests
            task = asyncio.create_task(self._run(request_id, operation, ctx, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            await self._run(request_id, operation, ctx, request)

    def _room_to_wait(self, op: str) -> None:
        """`RequestLimitError` if ``max_waiting_requests`` already run beside the others: each holds
        its reply until the client reads it, so a client that pipelines thousands and never reads
        would make the server hold them all."""
        limit = self.conn.limits.max_waiting_requests
        if len(self._tasks) >= limit:
            raise RequestLimitError(f"{op}: {len(self._tasks)} requests that wait (fetch, read, dlq_replay, "
                                    f"...) are in flight on this connection, max_waiting_requests={limit}")

    async def _run_together(self, together: native_runs.Together, run: list[Pending]) -> None:
        """Requests that share one engine call; their replies go out in one write."""
        assert self.ctx is not None
        for pending in run:
            self.conn.metrics.frames.labels("native", pending.op).inc()
        try:
            replies = await together.run(self.ctx, [pending.request for pending in run])
        except Exception as error:  # noqa: BLE001 - each request of the run is answered with it
            if not isinstance(error, BrokerError):
                self.conn.log.exception("request_failed", op=run[0].op)
            replies = [error] * len(run)
        frames = [native_codec.encode(self._error(pending.request_id, reply)
                                      if isinstance(reply, Exception) else
                                      {"id": pending.request_id, "ok": True, **reply})
                  for pending, reply in zip(run, replies)]
        try:
            await self.conn.send(b"".join(frames))
        except (ConnectionError, ConnectionTimedOut):
            self.conn.abort()

    def _context(self) -> native_ops.Context:
        if self.ctx is None:
            if self.guard.required:
                raise AuthenticationError("send hello with credentials first")
            self.ctx = self._new_context(OPEN)
        return self.ctx

    def _new_context(self, principal: Principal) -> native_ops.Context:
        return native_ops.Context(self.engine, principal, self.conn.metrics,
                                  self.conn.limits.max_fetch_wait, self.conn.limits.max_subscriptions,
                                  self.conn.limits.max_fetch_messages,
                                  window=ByteWindow(self.conn.limits.max_unacked_bytes), quota=self.quota,
                                  topic_quota=self.topic_quota)

    async def _hello(self, request_id: int, request: Mapping[str, Any]) -> None:
        if self.ctx is not None:
            raise MalformedFrameError("hello: this connection has already said hello")
        user = native_ops.need(request, "hello", "user", str, None)
        password = native_ops.need(request, "hello", "password", str, None)
        try:  # counted, logged and delayed by the guard
            principal = await self.guard.authenticate(self.conn, user, password)
        except AuthenticationError as error:
            await self._reply_error(request_id, error, fatal=True)
            raise _Close from error
        self.ctx = self._new_context(principal)
        await self._send({"id": request_id, "ok": True, "server": SERVER_NAME,
                          "protocol": native_codec.VERSION, "user": principal.name,
                          "max_frame_size": self.conn.limits.max_frame_size,
                          "max_waiting_requests": self.conn.limits.max_waiting_requests})

    async def _run(self, request_id: int, operation: Operation,
                   ctx: native_ops.Context, request: Mapping[str, Any]) -> None:
        together = native_runs.TOGETHER.get(operation.name)
        try:
            reply = await (together.alone(ctx, request) if together is not None else
                           native_ops.serve(ctx, operation, request))
        except BrokerError as error:
            await self._reply_error(request_id, error)
        except Exception as error:  # the engine's bug (or a full disk) must not end the server
            if (full := disk_full(error)) is not None:
                await self._reply_error(request_id, full)
                return
            self.conn.log.exception("request_failed", op=request.get("op"))
            await self._reply_error(request_id, error)
        else:
            try:
                await self._send({"id": request_id, "ok": True, **reply})
            except (ConnectionError, ConnectionTimedOut):
                self.conn.abort()

    async def _reply_error(self, request_id: int, error: Exception, fatal: bool = False) -> bool:
        """Report ``error`` for ``request_id``; whether the connection must now close."""
        reply = self._error(request_id, error, fatal)
        try:
            await self._send(reply)
        except (ConnectionError, ConnectionTimedOut):
            self.conn.abort()
            return True
        if reply["fatal"]:
            self.conn.told_fatal()
        return bool(reply["fatal"])

    def _error(self, request_id: int, error: Exception, fatal: bool = False) -> dict[str, Any]:
        """The error reply for ``request_id`` (counted)."""
        code = _code(error)
        self.conn.metrics.errors.labels("native", code).inc()
        described: dict[str, Any] = {"code": code, "type": type(error).__name__, "message": str(error)}
        if isinstance(error, LockedOutError):
            described["retry_after"] = round(error.retry_after, 3)
        return {"id": request_id, "ok": False, "fatal": fatal or getattr(error, "fatal", False),
                "error": described}

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


_KNOWN = frozenset(OPERATIONS) | {"hello"}


def _code(error: Exception) -> str:
    if isinstance(error, ServerError):
        return error.code
    if isinstance(error, BrokerError):
        return "broker_error"
    return "internal_error"


def _pending(payload: bytes) -> Pending:
    """A frame's request, or the error to answer it with (under its id, when it has one)."""
    request: dict[str, Any] = {}
    try:
        request = decode_body(payload)
        return Pending(native_ops.need(request, "request", "id", int), request, len(payload))
    except ServerError as error:
        return Pending(0, request, len(payload), error)


def _is_hello(payload: bytes) -> bool:
    try:
        return decode_body(payload).get("op") == "hello"
    except ServerError:
        return False


def _joining(together: native_runs.Together, first: Pending) -> Callable[[Pending], bool]:
    """Whether a queued request may run together with ``first``: same operation, same key."""
    key = together.key(first.request)
    return lambda queued: queued.op == first.op and together.key(queued.request) == key
