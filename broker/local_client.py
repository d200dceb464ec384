"""The client side of an embedded broker's local socket: what a process needs that does not own
the directory (`broker.local` has the frames' format and the owner's server).

It imports neither the engine nor the store nor structlog, so a short-lived process that only
reads (a Spark worker running the broker source, started afresh for every query) starts fast.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack

from broker import errors
from broker.errors import BrokerError, BrokerUnavailableError
from broker.protocol.calls import SyncCalls
from broker.protocol.operations import Operation

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
SOCKET_NAME = "broker.sock"


def socket_path(directory: str | Path) -> Path:
    return Path(directory) / SOCKET_NAME


def send_frame(sock: socket.socket, payload: Any) -> None:
    """``payload`` as one frame: its msgpack length first (see `broker.local`)."""
    data = msgpack.packb(payload, use_bin_type=True)
    sock.sendall(HEADER.pack(len(data)) + data)


def receive_frame(sock: socket.socket) -> Any:
    """The value of the next frame on ``sock``."""
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
            send_frame(sock, [op.name, dict(fields)])
            ok, result = receive_frame(sock)
        except (ConnectionError, OSError) as exc:
            self._forget(sock)
            raise BrokerUnavailableError(f"the broker owning {self.path.parent} is gone: {exc}") from exc
        if ok:
            return dict(result)
        name, text = result
        error = getattr(errors, name, BrokerError)
        raise (error if isinstance(error, type) and issubclass(error, BrokerError) else BrokerError)(text)

    def reachable(self) -> bool:
        """Whether a process serves the socket (this thread's connection is made now, and kept)."""
        try:
            self._connection()
        except BrokerUnavailableError:
            return False
        return True

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


def connect_local(directory: str | Path) -> LocalClient | None:
    """A client of the process that serves ``directory``'s socket, connected; None when nothing
    answers there (no owner, or one still starting: `broker.embedded` owns or waits)."""
    client = LocalClient(directory)
    return client if client.reachable() else None
