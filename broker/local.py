"""The local socket of an embedded broker: how other processes on the machine reach it.

One process owns an embedded broker's directory (the store's lock). It
serves the `BrokerApi` on ``DIR/broker.sock`` with `LocalServer`; another
process that opens the same directory gets a `LocalClient`, so ``reliable
publish`` or ``reliable dlq`` from a shell, or a second worker, keep working
while a worker runs, with the same guarantees.

Frames: a 4-byte big-endian length, then msgpack: a request is ``[method,
args, kwargs]``, a reply ``[True, result]`` or ``[False, [error class name,
text]]``. Only the `BrokerApi` calls are served; values travel as dicts of
their fields. Each client thread has a connection of its own, so a long-poll
fetch never holds up another thread's ack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import structlog

from broker import errors
from broker.delivery.api import BrokerApi
from broker.delivery.values import (
    Delivery,
    GroupInfo,
    OutgoingMessage,
    Placement,
    QueueLag,
    TopicInfo,
    as_dict,
)
from broker.errors import BrokerError, BrokerUnavailableError

log = structlog.get_logger("broker.local")
HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
SOCKET_NAME = "broker.sock"

# method -> how its reply is rebuilt on the client
_REPLIES: dict[str, Callable[[Any], Any]] = {
    "publish": lambda r: [Placement(**p) for p in r],
    "publish_to_group": lambda r: [Placement(**p) for p in r],
    "join": str,
    "leave": lambda r: None,
    "fetch": lambda r: [Delivery(**d) for d in r],
    "ack": lambda r: None,
    "nack": lambda r: None,
    "dead_letter": lambda r: None,
    "extend": lambda r: None,
    "commit": lambda r: None,
    "assignment": lambda r: [(t, q) for t, q in r],
    "pending": int,
    "next_due": lambda r: r,
    "topics": lambda r: [TopicInfo(**t) for t in r],
    "groups": lambda r: [GroupInfo(**{**g, "topics": tuple(g["topics"])}) for g in r],
    "lag": lambda r: [QueueLag(**q) for q in r],
    "dlq_list": lambda r: [Delivery(**d) for d in r],
    "read": lambda r: [Delivery(**d) for d in r],
    "queue_offsets": lambda r: r,
    "group_offsets": lambda r: r,
    "commit_group": lambda r: None,
    "dlq_replay": int,
    "dlq_purge": int,
}


def socket_path(directory: str | Path) -> Path:
    return Path(directory) / SOCKET_NAME


def _plain(value: Any) -> Any:
    if (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(value, Delivery):
        return {name: _plain(field) for name, field in as_dict(value).items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return [[_plain(k), _plain(v)] for k, v in value.items()]  # (topic, queue) keys
    return value


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
                method, args, kwargs = _receive(self.request)
            except (ConnectionError, OSError, ValueError):
                return
            _send(self.request, self.server.call(method, args, kwargs))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, api: BrokerApi) -> None:
        self.api = api
        super().__init__(path, _Handler)

    def call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        if method not in _REPLIES:
            return [False, ["BrokerError", f"unknown local call {method!r}"]]
        if method in ("publish", "publish_to_group"):
            args = [*args[:-1], [OutgoingMessage(**m) for m in args[-1]]]
        if method == "commit":
            args = [args[0], {(t, q): o for (t, q), o in args[1]}]
        try:
            return [True, _plain(getattr(self.api, method)(*args, **kwargs))]
        except BrokerError as exc:
            return [False, [type(exc).__name__, str(exc)]]
        except Exception as exc:  # reported to the caller; the server goes on
            log.exception("local.call_failed", method=method)
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


class LocalClient:
    """A `BrokerApi` over the local socket of the process that owns the directory."""

    def __init__(self, directory: str | Path) -> None:
        self.path = socket_path(directory)
        self._local = threading.local()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in _REPLIES:
            raise AttributeError(method)
        return lambda *args, **kwargs: self._call(method, list(args), kwargs)

    def _call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        sock = self._connection()
        try:
            _send(sock, [method, _plain(args), _plain(kwargs)])
            ok, result = _receive(sock)
        except (ConnectionError, OSError) as exc:
            self._forget(sock)
            raise BrokerUnavailableError(f"the broker owning {self.path.parent} is gone: {exc}") from exc
        if ok:
            return _REPLIES[method](result)
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
