"""The broker server: the native and STOMP listeners (and metrics) in front of one `Engine`.

Both listeners share the connection limits of `broker.server.admission` (in all,
and per client address); a connection over one is told why (a native error
frame or a STOMP ERROR) before a byte of it is read, and closed. `BrokerServer.stop`
stops accepting, ends every session (their members leave the engine, so
what they held is redelivered) and returns once all are closed. `serve`
runs a server until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

import structlog

from broker.errors import BrokerConfigError
from broker.local import bind_owner_only
from broker.protocol import codec as native_codec
from broker.protocol.errors import ConnectionLimitError
from broker.server.admission import Admission, CapNames
from broker.server.config import Limits, ServerConfig
from broker.server.connection import Connection
from broker.server.engine import Engine
from broker.server.guard import AuthGuard
from broker.server.metrics import ServerMetrics
from broker.server.native_session import NativeSession
from broker.server.quota import GroupQuota, Owners, TopicQuota
from broker.server.stomp_codec import StompFrame, encode
from broker.server.stomp_session import StompSession
from broker.store.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger("broker.server")
METRICS_CONNECTIONS, METRICS_PER_ADDRESS = 32, 4
"""Connections the metrics listener holds at once, in all and from one address: a scraper needs
one; each waits up to 10 s for its request, so uncapped they were file descriptors for the taking."""
METRICS_CAPS = CapNames("the metrics listener", "connections", "connections from one address",
                        "scrape over fewer connections", settings=False)
"""What the metrics listener's refusals name: its fixed caps, not the broker's max_connections."""
Session = Callable[[Connection], Awaitable[None]]


class BrokerServer:
    """Listeners and open sessions of one broker; use ``async with`` or `start` / `stop`."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None,
                 metrics: ServerMetrics | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        """``clock``: the time of address lock-outs (`broker.server.guard`) and of the log lines
        about refused connections (`broker.server.admission`)."""
        self.engine = engine
        self.config = config or ServerConfig()
        self.metrics = metrics or ServerMetrics()
        self.authenticator = self.config.authenticator()
        self.guard = AuthGuard(self.authenticator, self.config.limits, self.metrics, clock)
        owners = Owners(engine.state_file("quota-owners.journal"))
        self.quota = GroupQuota(self.config.limits.max_groups_per_user, engine.has_group, owners)
        self.topic_quota = TopicQuota(self.config.limits.max_topics_per_user, engine.has_topic, owners)
        self.admission = Admission(self.config.limits, self.metrics, clock)
        self.scrapes = Admission(Limits(max_connections=METRICS_CONNECTIONS,
                                        max_connections_per_address=METRICS_PER_ADDRESS), self.metrics, clock,
                                 METRICS_CAPS)
        self._servers: dict[str, asyncio.Server] = {}
        self._sessions: set[asyncio.Task[None]] = set()
        self._scraping: set[asyncio.Task[None]] = set()  # requests to the metrics listener

    def port(self, listener: str) -> int:
        """The port ``native``, ``stomp`` or ``metrics`` is bound to (useful with port 0)."""
        return int(self._servers[listener].sockets[0].getsockname()[1])

    @property
    def open_connections(self) -> int:
        return len(self._sessions)

    def _lag(self) -> list[tuple[str, str, int, int]]:
        api = self.engine.api
        return [(group.name, q.topic, q.queue, q.lag) for group in api.groups() for q in api.lag(group.name)]

    async def start(self) -> None:
        self.metrics.lag_source = self._lag
        self.metrics.groups_source = lambda: len(self.engine.api.groups())
        self.metrics.user_groups_source = self.quota.made
        self.metrics.user_topics_source = self.topic_quota.made
        self.metrics.unacked_source = self.engine.unacked_bytes
        self.engine.observe_fsync(self.metrics.fsync_seconds.observe)
        tls = self.config.tls.context() if self.config.tls else None
        host = self.config.host
        self._servers["native"] = await _listen("port", self._accept("native", self._native, tls), host,
                                                self.config.port)
        if self.config.stomp_port is not None:
            self._servers["stomp"] = await _listen("stomp_port", self._accept("stomp", self._stomp, tls), host,
                                                   self.config.stomp_port)
        if self.config.metrics_port is not None:
            self._servers["metrics"] = await _listen("metrics_port", self._scrape, host, self.config.metrics_port)
        if self.config.unix_socket is not None:
            self._servers["unix"] = await self._unix_listener(self.config.unix_socket)
        log.info("server_started", host=host, tls=tls is not None, auth=self.authenticator.required,
                 unix_socket=self.config.unix_socket,
                 **{f"{name}_port": self.port(name) for name in self._servers if name != "unix"})

    async def _unix_listener(self, path: str) -> asyncio.Server:
        """The native protocol on a unix socket only this user may open (no TLS: it never leaves the host)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if Path(path).is_socket():
            os.unlink(path)  # left by a server that died, as asyncio's own unix server does
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_owner_only(sock, path)
        return await asyncio.start_unix_server(self._accept("native", self._native), sock=sock)

    async def stop(self) -> None:
        for server in self._servers.values():
            server.close()
        for task in [*self._sessions, *self._scraping]:
            task.cancel()
        await asyncio.gather(*self._sessions, *self._scraping, return_exceptions=True)
        for server in self._servers.values():
            await server.wait_closed()
        self.guard.close()
        log.info("server_stopped")

    async def __aenter__(self) -> BrokerServer:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.stop()

    def _accept(self, listener: str, session: Session, tls: ssl.SSLContext | None = None) -> Callable[
            [asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        """The listener's handler of an accepted connection. With ``tls`` the connection is admitted
        before its TLS handshake, which must end within ``handshake_timeout`` (asyncio's
        ``ssl=`` would admit it after a handshake allowed 60 s, holding it uncounted meanwhile)."""
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = Connection(listener, reader, writer, self.config.limits, self.metrics)
            refusal = self.admission.admit(listener, conn.host)
            if refusal is not None:
                await (self._refuse(conn, refusal) if tls is None else conn.close())  # TLS: no error unencrypted
                return
            task = asyncio.current_task()
            assert task is not None
            self._sessions.add(task)
            self.metrics.connections.labels(listener).inc()
            self.metrics.open.labels(listener).inc()
            try:
                if tls is not None and not await self._handshake(conn, writer, tls):
                    return
                await session(conn)
            except asyncio.CancelledError:
                await conn.close()
            except Exception:
                conn.log.exception("session_failed")
                conn.abort()
            finally:
                self._sessions.discard(task)
                self.admission.release(conn.host)
                self.metrics.open.labels(listener).dec()

        return accepted

    async def _handshake(self, conn: Connection, writer: asyncio.StreamWriter, tls: ssl.SSLContext) -> bool:
        """The TLS handshake of an admitted connection; False (the connection dropped) if it failed
        or did not end within ``handshake_timeout`` of the accept (the log-in that follows gets
        what is left of it, not a budget of its own)."""
        try:
            async with asyncio.timeout_at(conn.handshake_ends):
                await writer.start_tls(tls)
            return True
        except (OSError, ssl.SSLError, TimeoutError) as error:
            if isinstance(error, TimeoutError):
                self.metrics.timeouts.labels(conn.listener, "handshake").inc()
            conn.log.info("tls_handshake_failed", error=str(error)[:200] or type(error).__name__)
            conn.abort()
            return False

    async def _scrape(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection to the metrics listener, within its own small caps (closed unread past them)."""
        peer = writer.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) else None
        if self.scrapes.admit("metrics", host) is not None:
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._scraping.add(task)
        try:
            await self.metrics.serve_http(reader, writer)
        finally:
            self._scraping.discard(task)
            self.scrapes.release(host)

    async def _native(self, conn: Connection) -> None:
        await NativeSession(conn, self.engine, self.guard, self.quota, self.topic_quota).run()

    async def _stomp(self, conn: Connection) -> None:
        await StompSession(conn, self.engine, self.guard, self.quota, self.topic_quota).run()

    async def _refuse(self, conn: Connection, error: ConnectionLimitError) -> None:
        """Tell a client over a connection cap why, unread (counted and logged by the admission)."""
        if conn.listener == "native":
            frame = native_codec.encode({"id": 0, "ok": False, "fatal": True,
                                         "error": {"code": error.code, "message": str(error)}})
        else:
            frame = encode(StompFrame("ERROR", {"message": f"{error.code}: {error}"}))
        try:
            await conn.send(frame)
        except Exception:
            conn.abort()
        await conn.close()


def load_config(path: str | Path) -> ServerConfig:
    """The `ServerConfig` of the ``[broker]`` table in the settings file at ``path``."""
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BrokerConfigError(f"{path}: cannot read the settings file ({exc})") from exc
    return ServerConfig.from_mapping(document.get("broker", {}))


async def serve(engine: Engine, config: ServerConfig, stop: asyncio.Event | None = None,
                metrics: ServerMetrics | None = None) -> None:
    """Run a server until ``stop`` is set, or SIGINT / SIGTERM arrives; then shut down gracefully.
    ``metrics``: the server's (the console beside it counts in them too)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with BrokerServer(engine, config, metrics):
            await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def _listen(key: str, accept: Callable[..., Awaitable[None]], host: str, port: int) -> asyncio.Server:
    """A listener on ``host:port``; a port or address it cannot take is `BrokerConfigError` naming
    the setting (it was an ``OSError`` traceback)."""
    try:
        return await asyncio.start_server(accept, host, port)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise BrokerConfigError(f"broker.{key} = {port}: cannot listen on {host}:{port}: {reason}; "
                                "choose another port (0: any free one)") from exc
