"""The probe port against silent clients: bounded per address and in all, and each given a deadline.

The probe server ran a thread per connection and waited for a request for
ever: 200 sockets that send nothing held 200 threads and file descriptors of
the worker's own process until they went away (on a port that may face the
network: ``--metrics-host 0.0.0.0`` for a kubelet). Clients come from other
loopback addresses (127.0.0.2 and up) so the per-address bound can be seen.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from reliable import health
from reliable.health import MAX_CONNECTIONS, MAX_PER_ADDRESS, serve_probes
from reliable.testing import test_app
from tests.framework.test_health import eventually, get


@pytest.fixture
def probes(tmp_path: Path) -> Iterator[Callable[[float], ThreadingHTTPServer]]:
    """Starts the probe server of an app, giving each connection ``timeout`` seconds for its request."""
    app = test_app(tmp_path)
    servers: list[ThreadingHTTPServer] = []

    def start(timeout: float) -> ThreadingHTTPServer:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(health, "REQUEST_TIMEOUT", timeout)
            servers.append(serve_probes(app, 0))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
    app.close()


def silent(address: tuple[str, int], source: str, count: int) -> list[socket.socket]:
    """``count`` connections to ``address`` from ``source`` that send nothing."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(address)
        sockets.append(sock)
    return sockets


def open_ones(sockets: list[socket.socket]) -> list[socket.socket]:
    """Those the server has not closed (a closed one reads as end of file at once)."""
    readable, _, _ = select.select(sockets, [], [], 0)
    closed = {s for s in readable if s.recv(1, socket.MSG_PEEK) == b""}
    return [s for s in sockets if s not in closed]


def test_silent_sockets_of_one_address_leave_the_probes_to_everyone_else(probes) -> None:
    server = probes(600.0)
    threads = threading.active_count()
    hostile = silent(server.server_address, "127.0.0.2", 200)
    try:
        eventually(lambda: len(open_ones(hostile)) == MAX_PER_ADDRESS, "all but 4 closed at once", 30)
        assert threading.active_count() <= threads + MAX_PER_ADDRESS
        assert get(server.server_address[1], "/healthz")[0] == 503  # served: the app is not running
    finally:
        for sock in hostile:
            sock.close()


def test_the_probe_port_holds_at_most_its_connections_in_all(probes) -> None:
    server = probes(600.0)
    sources = [f"127.0.0.{n}" for n in range(3, 3 + MAX_CONNECTIONS // MAX_PER_ADDRESS + 2)]
    sockets = [sock for source in sources for sock in silent(server.server_address, source, MAX_PER_ADDRESS)]
    try:
        eventually(lambda: len(open_ones(sockets)) == MAX_CONNECTIONS, "held no more than the cap", 30)
    finally:
        for sock in sockets:
            sock.close()


def test_a_silent_socket_is_closed_at_its_deadline(probes) -> None:
    server = probes(0.5)
    (sock,) = silent(server.server_address, "127.0.0.1", 1)
    try:
        eventually(lambda: not open_ones([sock]), "closed by the server", 30)
        assert get(server.server_address[1], "/healthz")[0] == 503
    finally:
        sock.close()
