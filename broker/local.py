"""The local socket of an embedded broker: how other processes on the machine reach it.

One process owns an embedded broker's directory (the store's lock). It
serves the `BrokerApi` on ``DIR/broker.sock`` with `LocalServer`; another
process that opens the same directory gets a `LocalClient`, so ``reliable
publish`` or ``reliable dlq`` from a shell, or a second worker, keep working
while a worker runs, with the same guarantees.

Frames: a 4-byte big-endian length, then msgpack: a request is ``[operation,
fields]``, a reply ``[True, reply fields]`` or ``[False, [error class name,
text]]``, the operation's fields and reply exactly as the native protocol
carries them (`broker.protocol.operations`: both ends are derived from its
table). The local socket is the directory owner's own: it asks no
credentials, so only the OS user who owns the broker may open it (mode 0600,
whatever the umask: `bind_owner_only`), and the directory the broker creates
is that user's alone (0700, as PostgreSQL keeps its data directory). Each client thread has a connection of its own, so a long-poll
fetch never holds up another thread's ack. The client side (`LocalClient`) lives in
`broker.local_client`, which a process that only reads can import without the server's modules.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

import structlog

from broker.delivery.api import BrokerApi
from broker.errors import BrokerError, disk_full
from broker.local_client import LocalClient, receive_frame, send_frame, socket_path
from broker.protocol.operations import OPERATIONS

__all__ = ["LocalClient", "LocalServer", "socket_path"]
log = structlog.get_logger("broker.local")


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        while True:
            try:
                name, request = receive_frame(self.request)
            except (ConnectionError, OSError, ValueError):
                return
            send_frame(self.request, self.server.call(name, request))


def bind_owner_only(sock: socket.socket, path: str) -> None:
    """Bind the unix socket ``sock`` to ``path`` so that only this OS user may connect.

    Connecting takes write permission on the socket's file, which ``bind``
    creates with the process's umask (0o775 under a umask of 002, 0o777 under
    0). Linux takes the mode set on the socket before ``bind`` for the file, so
    no other user can connect even for an instant; it is set again after, for
    systems that do not.
    """
    with contextlib.suppress(OSError):
        os.fchmod(sock.fileno(), 0o600)
    sock.bind(path)
    os.chmod(path, 0o600)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, api: BrokerApi) -> None:
        self.api, self.path = api, path
        super().__init__(path, _Handler)

    def server_bind(self) -> None:
        bind_owner_only(self.socket, self.path)
        self.server_address = self.socket.getsockname()

    def call(self, name: str, request: Any) -> list[Any]:
        """Run the operation ``name`` of the table on the engine: ``[True, reply]`` or
        ``[False, [error class name, text]]``."""
        op = OPERATIONS.get(name)
        if op is None or not isinstance(request, dict):
            return [False, ["BrokerError", f"unknown local call {name!r}"]]
        try:
            return [True, op.answer(op.call(self.api, op.parse(request)))]
        except BrokerError as exc:
            return [False, [type(exc).__name__, str(exc)]]
        except Exception as exc:  # reported to the caller; the server goes on
            if (full := disk_full(exc)) is not None:
                return [False, [type(full).__name__, str(full)]]
            log.exception("local.call_failed", op=name)
            return [False, ["BrokerError", f"{type(exc).__name__}: {exc}"]]


SHUTDOWN_POLL = 0.02
"""Seconds between the server loop's looks at `LocalServer.close`'s request: socketserver's
default of 0.5 made every close, so every `reliable` command on an embedded broker, wait up to
half a second for nothing."""


class LocalServer:
    """Serves ``api`` on ``DIR/broker.sock`` from a background thread until `close`."""

    def __init__(self, api: BrokerApi, directory: str | Path) -> None:
        self.path = socket_path(directory)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by an owner that died; the store's lock says we own DIR now
        self._server = _Server(str(self.path), api)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SHUTDOWN_POLL,),
                                        name="broker-local", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
