"""A TCP forwarder the tests can cut, hang and restore: a real network outage of a real server."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``.

    `cut()` drops every connection and refuses new ones; `hang()` keeps every
    socket open (new ones are accepted too) but forwards nothing, as a server
    that stopped answering; `lose_next_reply()` lets requests through until
    the server answers one, then drops that answer and every connection: a
    request the server carried out whose client never learns it did (and,
    with ``then_cut``, a cut from that moment: the client cannot try again on
    a new connection until `restore()`).
    `restore()` ends a cut or a hang (the connections that hung are dropped:
    a stream that lost bytes cannot be resumed).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._hung = threading.Event()
        self._lose_reply = threading.Event()
        self._cut_after_reply = False
        self.replies_lost = 0
        self.chunks_swallowed = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._up.clear()
        self._drop_connections()

    def hang(self) -> None:
        self._hung.set()

    def lose_next_reply(self, then_cut: bool = False) -> None:
        self._cut_after_reply = then_cut
        self._lose_reply.set()

    def restore(self) -> None:
        if self._hung.is_set():
            self._drop_connections()
            self._hung.clear()
        self._up.set()

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _drop_connections(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            _close(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for a, b, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, replies), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                if self._hung.is_set():
                    self.chunks_swallowed += 1
                    continue
                if replies and self._lose_reply.is_set():
                    self._lose_reply.clear()
                    if self._cut_after_reply:
                        self._up.clear()
                    self.replies_lost += 1
                    self._drop_connections()
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _close(source)
            _close(sink)


def _close(s: socket.socket) -> None:
    """Shut down, then close: the FIN goes out even while another thread is blocked in ``recv``
    on the socket (a bare close would leave the server's side open, its transaction with it)."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
