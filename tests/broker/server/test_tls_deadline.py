"""With TLS, ``handshake_timeout`` is one budget from the accept to a logged-in session.

The TLS handshake had the whole budget, and the log-in after it the whole budget again: a client
could hold a connection, unauthenticated, for twice ``handshake_timeout``. A real TLS client here
spends most of the budget before its ClientHello, shakes hands, then sends nothing: the server
cuts it at the deadline counted from the accept, on both listeners.
"""

from __future__ import annotations

import socket
import ssl

import pytest

from broker.server.config import TlsConfig
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.certificates import self_signed
from tests.broker.server.threaded import counted
from tests.passwords import hash_password
from tests.waiting import wait_until

USERS = {"app": {"password_hash": hash_password("s3cret"), "admin": True}}
HANDSHAKE = 3.0
BEFORE_HELLO = 0.6 * HANDSHAKE  # spent before the ClientHello; the rest is left for the log-in
AFTER = 0.9 * HANDSHAKE  # the client waits this long after its handshake: past what was left, short of a new budget


def closed_within(sock: ssl.SSLSocket, timeout: float) -> bytes:
    """What the server sends until it closes the connection; TimeoutError if it is still open
    after ``timeout`` seconds of silence."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, ssl.SSLEOFError):
        pass
    return b"".join(chunks)


@pytest.mark.parametrize("listener", ["native", "stomp"])
def test_a_tls_client_silent_after_its_handshake_is_cut_at_the_deadline_from_the_accept(tmp_path, listener) -> None:
    cert, key = self_signed(tmp_path)
    client = ssl.create_default_context(cafile=str(cert))
    with threaded.serving(tmp_path, FakeClock(), USERS, tls=TlsConfig(str(cert), str(key)),
                          handshake_timeout=HANDSHAKE, idle_timeout=60) as server:
        with socket.create_connection(("127.0.0.1", server.port(listener)), timeout=BEFORE_HELLO) as raw:
            with pytest.raises(TimeoutError):
                raw.recv(1)  # nothing comes before a ClientHello: BEFORE_HELLO spent, still open
            raw.settimeout(HANDSHAKE - BEFORE_HELLO)
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as sock:  # a real handshake
                assert closed_within(sock, AFTER) == b""  # it had a whole budget again: still open
        wait_until(lambda: counted(server.metrics.timeouts, listener=listener, reason="handshake") == 1,
                   "the cut counted as a handshake timeout")
