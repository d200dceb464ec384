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
table). The local socket is the directory owner's own, reachable only
through the file system, so it asks no credentials. Each client thread has a connection of its own, so a long-poll
fetch never holds up another thread's ack.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import structlog

from broker import errors
from broker.delivery.api import BrokerApi
from broker.errors import BrokerError, BrokerUnavailableError
from broker.protocol.calls import SyncCalls
from broker.protocol.operations import OPERATIONS, Operation

log = structlog.get_logger("broker.local")
HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
SOCKET_NAME = "broker.sock"

def socket_path(directory: str | Path) -> Path:
    return Path(directory) / SOCKET_NAME


def _send(sock: socket.socket, payload: Any) -> None:
    data = msgpack.packb(payload, use_bin_type=True)
    sock.sendall(HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    size = HEADER.unpack(_exactly(sock, HEADER.size))[0]
    if size > MAX_FRAME:
        raise BrokerError(f"local socket frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    return msgpack.unpackb(_exactly(sock, size), raw=False, strict_map_key=False)


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the broker's local socket closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        while True:
            try:
                name, request = _receive(self.request)
            except (ConnectionError, OSError, ValueError):
                return
            _send(self.request, self.server.call(name, request))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, api: BrokerApi) -> None:
        self.api = api
        super().__init__(path, _Handler)

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
            log.exception("local.call_failed", op=name)
            return [False, ["BrokerError", f"{type(exc).__name__}: {exc}"]]


class LocalServer:
    """Serves ``api`` on ``DIR/broker.sock`` from a background thread until `close`."""

    def __init__(self, api: BrokerApi, directory: str | Path) -> None:
        self.path = socket_path(directory)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by an owner that died; the store's lock says we own DIR now
        self._server = _Server(str(self.path), api)
        self._thread = threading.Thread(target=self._server.serve_forever, name="broker-local",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LocalClient(SyncCalls):
    """A `BrokerApi` over the local socket of the process that owns the directory."""

    def __init__(self, directory: str | Path) -> None:
        self.path = socket_path(directory)
        self._local = threading.local()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()


    def _request(self, op: Operation, fields: Mapping[str, Any]) -> dict[str, Any]:
        sock = self._connection()
        try:
            _send(sock, [op.name, dict(fields)])
            ok, result = _receive(sock)
        except (ConnectionError, OSError) as exc:
            self._forget(sock)
            raise BrokerUnavailableError(f"the broker owning {self.path.parent} is gone: {exc}") from exc
        if ok:
            return dict(result)
        name, text = result
        error = getattr(errors, name, BrokerError)
        raise (error if isinstance(error, type) and issubclass(error, BrokerError) else BrokerError)(text)

    def _connection(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
            except OSError as exc:
                sock.close()
                raise BrokerUnavailableError(f"no broker serves {self.path}: {exc}") from exc
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def _forget(self, sock: socket.socket) -> None:
        self._local.sock = None
        sock.close()

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
