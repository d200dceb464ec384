"""Serving the console from a thread of its own, beside a broker server or a ``reliable`` process.

The listening socket is bound before the thread starts, so the port (0: any
free one) is known at once and a browser that connects early waits in the
backlog rather than being refused. uvicorn runs the ASGI app on the thread's
own event loop; it installs no signal handlers off the main thread, so the
owner's SIGTERM handling stays the owner's. Its h11 protocol is
`broker.console.listener`'s, which bounds what one client can hold.
"""

from __future__ import annotations

import socket
import threading

import structlog
import uvicorn
from starlette.applications import Starlette

from broker.console.config import ConsoleConfig
from broker.console.history import History
from broker.console.listener import MAX_HEAD, protocol_for
from broker.console.sources import Backlog, BrokerView, Counters, LetterBook
from broker.console.web import build_console
from broker.errors import BrokerConfigError
from broker.server.auth import Authenticator
from broker.server.metrics import ListenerMetrics, ServerMetrics
from broker.store.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger("broker.console")


class ConsoleServer:
    """One console listener; `start` binds and serves, `stop` ends both and the lag sampler."""

    def __init__(self, app: Starlette, config: ConsoleConfig, history: History | None = None,
                 clock: Clock = SYSTEM_CLOCK, metrics: ServerMetrics | ListenerMetrics | None = None) -> None:
        """``metrics``: where refused connections are counted (a broker server's; else a registry of
        the console's own, ``self.metrics.registry``)."""
        self.config, self.history = config, history
        self.metrics = metrics or ListenerMetrics()
        self.server = uvicorn.Server(uvicorn.Config(app, http=protocol_for(config, self.metrics, clock), ws="none",
                                                    h11_max_incomplete_event_size=MAX_HEAD, log_level="warning",
                                                    lifespan="off", access_log=False, proxy_headers=False))
        self.socket: socket.socket | None = None
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self.socket is not None, "start() first"
        return int(self.socket.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> ConsoleServer:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((self.config.host, self.config.port))
        except OSError as exc:
            self.socket.close()
            raise BrokerConfigError(f"broker.console_port = {self.config.port}: cannot listen on "
                                    f"{self.config.host}:{self.config.port} ({exc})") from exc
        self.socket.listen(128)
        if self.history is not None:
            self.history.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="console", daemon=True)
        self.thread.start()
        log.info("console.serving", url=self.url)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.history is not None:
            self.history.stop()
        if self.socket is not None:
            self.socket.close()


def start_console(config: ConsoleConfig, authenticator: Authenticator, view: BrokerView | None,
                  letters: LetterBook | None = None, backlog: Backlog | None = None,
                  counters: Counters | None = None, clock: Clock = SYSTEM_CLOCK,
                  metrics: ServerMetrics | ListenerMetrics | None = None) -> ConsoleServer:
    """Build the console over ``view`` (the broker, if any), ``letters`` and ``backlog`` (the
    framework's dead letters and outbox), and serve it; ``clock`` ages its sessions, ``metrics``
    counts its refused connections (see `ConsoleServer`)."""
    if not authenticator.required and not config.loopback:
        raise BrokerConfigError(f"broker.console_host = {config.host!r}: a console without users may only "
                                "bind a loopback address; add [broker.users]")
    history = History(view, config.sample_interval, config.history) if view is not None else None
    app = build_console(config, authenticator, view, letters, history, backlog, counters, clock=clock)
    return ConsoleServer(app, config, history, clock, metrics).start()
