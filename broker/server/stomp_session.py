"""One STOMP connection: CONNECT, then frames dispatched in order; any error is ERROR and close.

As STOMP 1.2 says, the server closes the connection after an ERROR frame.
Heart-beats are negotiated on CONNECT: the server sends an EOL at the agreed
interval and drops a client silent for twice its own.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

from broker.errors import BrokerError
from broker.protocol.errors import LockedOutError, MalformedFrameError, ProtocolError
from broker.server.auth import Principal
from broker.server.connection import Connection, ConnectionTimedOut
from broker.server.engine import Engine
from broker.server.guard import AuthGuard
from broker.server.quota import GroupQuota, TopicQuota
from broker.server.stomp_codec import HEARTBEAT, StompDecoder, StompFrame, encode, parse_number
from broker.server.stomp_frames import CLIENT_COMMANDS, StompHandlers

SERVER = "reliable-broker/1"
SUPPORTED = ("1.0", "1.1", "1.2")
#: how often the server can send heart-beats, and how often it wants them (ms)
SERVER_HEARTBEAT = (1000, 1000)


class StompSession:
    """Serves one STOMP connection."""

    _ids = itertools.count(1)

    def __init__(self, conn: Connection, engine: Engine, guard: AuthGuard, quota: GroupQuota,
                 topic_quota: TopicQuota) -> None:
        self.conn = conn
        self.engine = engine
        self.guard = guard
        self.quota, self.topic_quota = quota, topic_quota
        self.version = "1.2"
        self.session_id = f"session-{next(self._ids)}"
        # until CONNECT passes, frames are small: an unauthenticated client cannot make the server
        # buffer max_frame_size (CONNECT is handled before the next frame is parsed)
        self.decoder = StompDecoder(conn.limits.handshake_frame_size, limit_name="max_handshake_frame_size")
        self.handlers: StompHandlers | None = None
        self._read_timeout = conn.limits.idle_timeout
        self._beats_expected = False
        self._heartbeat: asyncio.Task[None] | None = None
        self._failure: asyncio.Future[BaseException] | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._failure = loop.create_future()
        try:
            await self._serve()
        except ProtocolError as error:
            await self._error(error, None)
        except BrokerError as error:
            await self._error(error, None)
        except ConnectionTimedOut as timeout:
            if timeout.reason != "slow_client":  # Connection.send counts a slow client itself
                self.conn.metrics.timeouts.labels("stomp", timeout.reason).inc()
            self.conn.log.info("connection_timed_out", reason=timeout.reason)
        except (ConnectionError, _Done):
            pass
        finally:
            await self._end()

    async def _serve(self) -> None:
        while True:
            data = await self._read()
            if not data:
                return
            for frame in self.decoder.frames(data):
                command = frame.command if frame.command in CLIENT_COMMANDS else "unknown"
                self.conn.metrics.frames.labels("stomp", command).inc()
                await self._dispatch(frame)

    async def _read(self) -> bytes:
        """The next chunk, or the failure a subscription's delivery task reported.

        Until CONNECT is served, reads end at the handshake deadline, however
        many bytes (heart-beats, a frame in pieces) arrive before it. A silent
        subscriber (`_listening`) is read from again, however long it stays silent.
        """
        while True:
            try:
                return await self._read_once()
            except ConnectionTimedOut as timeout:
                if timeout.reason == "handshake" or not self._listening:
                    raise

    async def _read_once(self) -> bytes:
        assert self._failure is not None
        timeout = self._read_timeout
        if self.handlers is None:
            timeout = self.conn.handshake_ends - asyncio.get_running_loop().time()
            if timeout <= 0:
                raise ConnectionTimedOut("handshake")
        reading = asyncio.ensure_future(self.conn.read(timeout))
        either: list[asyncio.Future[Any]] = [reading, self._failure]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if self._failure.done():
            reading.cancel()
            raise self._failure.result()
        try:
            return reading.result()
        except ConnectionTimedOut:
            if self.handlers is None:
                raise ConnectionTimedOut("handshake") from None
            raise

    @property
    def _listening(self) -> bool:
        """Whether the client may be silent however long: it subscribed and promised no heart-beats,
        so it waits for MESSAGE frames (as a native long poll in flight); a peer that vanished is
        found by TCP keepalive (`broker.server.connection.KEEPALIVE`)."""
        return self.handlers is not None and bool(self.handlers.subscriptions) and not self._beats_expected

    async def _dispatch(self, frame: StompFrame) -> None:
        try:
            if self.handlers is None:
                await self._connect(frame)
            else:
                await self.handlers.handle(frame)
        except (ProtocolError, BrokerError) as error:
            await self._error(error, frame.get("receipt"))
            raise _Done from error
        if frame.command == "DISCONNECT":
            raise _Done

    async def _connect(self, frame: StompFrame) -> None:
        if frame.command not in ("CONNECT", "STOMP"):
            raise MalformedFrameError(f"expected CONNECT or STOMP first, got {frame.command}")
        accepted = (frame.get("accept-version") or "1.0").split(",")
        common = [v for v in SUPPORTED if v in accepted]
        if not common:
            raise MalformedFrameError(f"none of the versions {accepted} is supported; "
                                      f"this server speaks {','.join(SUPPORTED)}")
        self.version = self.decoder.version = common[-1]
        principal = await self._authenticate(frame)
        client_send, client_want = _heartbeat(frame.get("heart-beat"))
        send_every = max(SERVER_HEARTBEAT[0], client_want) if client_want else 0
        expect_every = max(SERVER_HEARTBEAT[1], client_send) if client_send else 0
        idle = self.conn.limits.idle_timeout  # bounds silence whatever beats a client promises
        self._read_timeout = min(2 * expect_every / 1000, idle) if expect_every else idle
        self._beats_expected = bool(expect_every)
        self.handlers = StompHandlers(self, principal)
        self.decoder.max_frame_size, self.decoder.limit_name = self.conn.limits.max_frame_size, "max_frame_size"
        await self.send(StompFrame("CONNECTED", {
            "version": self.version, "heart-beat": f"{SERVER_HEARTBEAT[0]},{SERVER_HEARTBEAT[1]}",
            "server": SERVER, "session": self.session_id}))
        if send_every:
            self._heartbeat = asyncio.create_task(self._beat(send_every / 1000))

    async def _authenticate(self, frame: StompFrame) -> Principal:
        """The CONNECT's principal; a refusal is counted, logged and delayed by the guard."""
        return await self.guard.authenticate(self.conn, frame.get("login"), frame.get("passcode"))

    async def _beat(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await self.conn.send(HEARTBEAT)

    async def send(self, frame: StompFrame) -> None:
        await self.conn.send(encode(frame, self.version))

    def report_failure(self, error: BaseException) -> None:
        """A background task failed: the connection ends with that error."""
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(error)

    async def _error(self, error: Exception, receipt: str | None) -> None:
        code = getattr(error, "code", "broker_error")
        self.conn.metrics.errors.labels("stomp", code).inc()
        self.conn.log.info("stomp_error", code=code, error=str(error))
        headers = {"message": f"{code}: {str(error).splitlines()[0][:200]}",
                   "content-type": "text/plain"}
        if receipt:
            headers["receipt-id"] = receipt
        if isinstance(error, LockedOutError):
            headers["retry-after"] = str(math.ceil(error.retry_after))  # seconds, as HTTP's
        if code == "unsupported_version" or "versions" in str(error):
            headers["version"] = ",".join(SUPPORTED[1:])
        try:
            await self.send(StompFrame("ERROR", headers, str(error).encode()))
            self.conn.told_fatal()  # STOMP closes after every ERROR
        except (ConnectionError, ConnectionTimedOut):
            self.conn.abort()

    async def _end(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self.handlers is not None:
            await self.handlers.close()
        await self.conn.close()


class _Done(Exception):
    """Internal: the connection ends normally (DISCONNECT, or after an ERROR frame)."""


def _heartbeat(value: str | None) -> tuple[int, int]:
    if not value:
        return 0, 0
    parts = value.split(",")
    if len(parts) != 2:
        raise MalformedFrameError(f"header heart-beat {value[:40]!r} is not two numbers of milliseconds")
    send, want = (parse_number("heart-beat", part.strip(), MalformedFrameError) for part in parts)
    return send, want
