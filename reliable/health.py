"""Health probes: ``/healthz`` (alive), ``/readyz`` (ready), ``/metrics``, on the metrics port.

Spring Boot Actuator's split, for an orchestrator:
* **alive** (``/healthz``): the app's run loop is running and has gone round
  within `LIVENESS_SECONDS` (a worker stuck forever is not alive);
* **ready** (``/readyz``): alive, no worker is waiting out a transport outage,
  the store answers a read, and its disk is not refusing writes (a full disk:
  every message would be deferred; ``store_refusal`` says why, until a write
  commits again). A cache that is down is reported but keeps the app ready:
  the pipeline degrades to the store alone.
Both answer 200 or 503 with a JSON body saying which check failed; any other
path is 404. The port may face a network (``host``), so what one client can
hold is bounded, as on the broker's metrics port: `MAX_CONNECTIONS` at once,
`MAX_PER_ADDRESS` from one address (the others are closed unread), each given
`REQUEST_TIMEOUT` seconds to send its request: silent sockets by the thousand
would otherwise hold a thread and a file descriptor each of the worker's own
process, which its store and transport connections need.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from backends.clock import Clock
from backends.errors import ReliableError

if TYPE_CHECKING:
    from reliable.app import App

LIVENESS_SECONDS = 300.0
"""A run loop that has not gone round for this long is not alive (a handler stuck that long)."""
MAX_CONNECTIONS, MAX_PER_ADDRESS, REQUEST_TIMEOUT = 32, 4, 10.0
"""Connections the probe server holds at once, in all and from one address (a scraper and a
kubelet need one each), and the seconds each has to send its request."""


class Member(Protocol):
    """What readiness asks of a worker."""

    def transport_reachable(self) -> bool: ...


class RunState:
    """Whether the app's run loop is running, when it last went round, and its workers."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: Sequence[Member] = ()
        self._running = False
        self._beat = 0.0

    def began(self, workers: Sequence[Member]) -> None:
        with self._lock:
            self._workers, self._running, self._beat = workers, True, self._clock.monotonic()

    def beat(self) -> None:
        self._beat = self._clock.monotonic()

    def ended(self) -> None:
        with self._lock:
            self._workers, self._running = (), False

    def alive(self) -> dict[str, Any]:
        """The liveness checks, each true or false."""
        with self._lock:
            age = self._clock.monotonic() - self._beat
            return {"running": self._running, "loop_recent": self._running and age < LIVENESS_SECONDS}

    def transports_reachable(self) -> bool:
        with self._lock:
            return all(w.transport_reachable() for w in self._workers)


REPORTED = frozenset({"cache_degraded", "store_refusal"})
"""Keys of the readiness body that inform and are not checks."""


def readiness(app: App) -> dict[str, Any]:
    """The readiness checks of ``app``: alive, transport and store reachable, the store's disk
    taking writes (the cache only reported)."""
    checks: dict[str, Any] = {**app.run_state.alive(), "transport": app.run_state.transports_reachable()}
    try:
        app.store.ping()
        checks["store"] = True
    except ReliableError:
        checks["store"] = False
    refusal = app.store.write_refusal()
    checks["store_writes"] = refusal is None
    if refusal is not None:
        checks["store_refusal"] = refusal
    checks["cache_degraded"] = app.stats().get("cache_degraded", 0)
    return checks


def _ok(checks: dict[str, Any]) -> bool:
    return all(v for k, v in checks.items() if k not in REPORTED)


def serve_probes(app: App, port: int, host: str = "127.0.0.1",
                 registry: CollectorRegistry = REGISTRY) -> ThreadingHTTPServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` for ``app`` from a background thread
    (``server.server_address`` has the port bound; 0 binds any)."""
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
        "/healthz": lambda: _probe(app.run_state.alive()),
        "/readyz": lambda: _probe(readiness(app)),
    }

    class Probes(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT  # for the request line and headers

        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            route = routes.get(self.path.split("?", 1)[0])
            status, kind, body = route() if route else (404, "text/plain", b"not found: /metrics, /healthz, /readyz\n")
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes are not logged
            pass

    server = _ProbeServer((host, port), Probes)
    threading.Thread(target=server.serve_forever, name="reliable-probes", daemon=True).start()
    return server


class _ProbeServer(ThreadingHTTPServer):
    """A thread per connection, for `MAX_CONNECTIONS` at once and `MAX_PER_ADDRESS` from one address."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._held: Counter[str] = Counter()
        self._held_lock = threading.Lock()
        super().__init__(address, handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Take a slot for the connection, or refuse it (`shutdown_request` closes it unread)."""
        with self._held_lock:
            if self._held.total() >= MAX_CONNECTIONS or self._held[client_address[0]] >= MAX_PER_ADDRESS:
                return False
            self._held[client_address[0]] += 1
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._held_lock:
                self._held[client_address[0]] -= 1
                if not self._held[client_address[0]]:
                    del self._held[client_address[0]]


def _probe(checks: dict[str, Any]) -> tuple[int, str, bytes]:
    return (200 if _ok(checks) else 503), "application/json", json.dumps(checks).encode()
