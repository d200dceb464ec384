"""TLS for a connection that one thread reads while others write (`broker.client.Client`).

An ``ssl.SSLSocket`` must not be used by two threads at once: OpenSSL's SSL object
is not thread-safe, and with the client's reader thread blocked in ``recv()`` while
another thread sent a request, the send or the read failed with a spurious EOF
(the first publish of 25 fresh TLS clients in 300, on a quiet machine). Here the
TLS state lives in memory buffers (``SSLContext.wrap_bio``) and is touched only
under a lock; only the plain socket is read and written at the same time, which
the kernel allows. Bytes leave in the order TLS made them (a send lock), since
each record carries its sequence number.
"""

from __future__ import annotations

import socket
import ssl
import threading

CHUNK = 1 << 16


class TlsSocket:
    """The part of ``socket.socket`` the client uses, over TLS: blocking ``recv`` and ``sendall``."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str) -> None:
        self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=server_hostname)
        self._tls_lock = threading.Lock()  # the SSL object and its buffers
        self._send_lock = threading.Lock()  # taken before the TLS lock: records leave in order
        while True:  # the handshake, on this thread alone (under the socket's connect timeout)
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._sock.sendall(self._outgoing.read())
                self._feed(self._sock.recv(CHUNK))
        self._sock.sendall(self._outgoing.read())

    def sendall(self, data: bytes) -> None:
        with self._send_lock:
            with self._tls_lock:
                self._tls.write(data)  # into a memory buffer: all of it at once
                records = self._outgoing.read()
            self._sock.sendall(records)

    def recv(self, size: int) -> bytes:
        """Up to ``size`` bytes of plaintext; b"" once the peer has closed."""
        while True:
            with self._tls_lock:
                try:
                    return self._tls.read(size)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:  # the peer's close_notify
                    return b""
            data = self._sock.recv(CHUNK)  # the plain socket: no lock held while blocked
            with self._tls_lock:
                self._feed(data)
                answer = self._outgoing.pending  # reading may make records to send (a key update)
            if answer:
                with self._send_lock:
                    with self._tls_lock:
                        records = self._outgoing.read()
                    self._sock.sendall(records)

    def _feed(self, data: bytes) -> None:
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()  # the next read raises SSLEOFError: a connection cut without close_notify

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
