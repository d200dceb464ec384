"""One client address cannot fill the server: connections per address are capped, on both listeners
together, before a byte is read; an override lifts the cap of a load balancer's address.

Real sockets and real clients (the project's and stomp.py) from distinct client addresses (any of
127.0.0.0/8 is this machine's); the server in this process, with a fake clock for its log lines.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import stomp
from stomp.exception import StompException
from structlog.testing import capture_logs

from broker.client import Client
from broker.errors import BrokerUnavailableError
from broker.protocol.codec import FrameDecoder, decode_body
from broker.server.admission import REFUSALS_LOGGED_EVERY, Admission
from broker.server.config import Limits, TlsConfig
from broker.server.metrics import ServerMetrics
from broker.server.server import METRICS_CONNECTIONS, METRICS_PER_ADDRESS, BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.certificates import self_signed
from tests.broker.server.threaded import ClientFrom, counted, native
from tests.passwords import hash_password
from tests.waiting import wait_until

PASSWORD = "s3cret"
USERS = {"app": {"password_hash": hash_password(PASSWORD), "admin": True}}
PER_ADDRESS = "max_connections_per_address"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@contextmanager
def serving(tmp_path: Path, clock: FakeClock, **limits: Any) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, clock, USERS, **limits) as server:
        yield server


def open_count(server: BrokerServer) -> int:
    return int(server.metrics.totals()["connections_open"])


def refused(server: BrokerServer, reason: str) -> float:
    return counted(server.metrics.refused, reason=reason)


def connect(server: BrokerServer, listener: str, source: str) -> socket.socket:
    """A raw connection from ``source`` that sends nothing (it never authenticates)."""
    return socket.create_connection(("127.0.0.1", server.port(listener)), timeout=30, source_address=(source, 0))


@contextmanager
def held(server: BrokerServer, listeners: list[str], source: str) -> Iterator[list[socket.socket]]:
    """Silent connections from ``source``, one per listener named, each admitted before the next;
    closed, and seen closed by the server, at the end."""
    base = open_count(server)
    with ExitStack() as stack:
        socks = []
        for n, listener in enumerate(listeners, 1):
            socks.append(stack.enter_context(connect(server, listener, source)))
            wait_until(lambda: open_count(server) >= base + n, "the server to admit the connection")  # noqa: B023
        yield socks
    wait_until(lambda: open_count(server) <= base, "the server to see the connections closed")


def received(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def native_refusal(server: BrokerServer, source: str) -> dict[str, Any]:
    with connect(server, "native", source) as sock:
        frames = FrameDecoder(1 << 20).feed(received(sock))
    assert len(frames) == 1, frames
    reply = decode_body(frames[0])
    assert reply["ok"] is False and reply["fatal"] is True and reply["id"] == 0
    return dict(reply["error"])


def stomp_connect(server: BrokerServer, source: str) -> str:
    """stomp.py's CONNECT from ``source``: '' if connected, else the ERROR frame's message."""
    connection = stomp.Connection12([("127.0.0.1", server.port("stomp"))], bind_host_port=(source, 0),
                                    reconnect_attempts_max=1)
    errors: list[str] = []
    connection.set_listener("errors", type("Errors", (stomp.ConnectionListener,), {
        "on_error": lambda self, frame: errors.append(frame.headers.get("message", ""))})())
    try:
        connection.connect("app", PASSWORD, wait=True)
    except (StompException, OSError):  # refused; the server may have closed before CONNECT was sent
        return wait_until(lambda: errors, "the ERROR frame")[0]
    connection.disconnect()
    return ""


def served(server: BrokerServer, source: str) -> bool:
    client = ClientFrom(native(server), source, user="app", password=PASSWORD)
    try:
        return isinstance(client.topics(), list)
    finally:
        client.close()


def test_one_address_holding_silent_connections_no_longer_fills_the_server(tmp_path, clock) -> None:
    """The attack: one address opens connections it never authenticates, as many as it can. Before
    the per-address cap they took all ``max_connections`` and every other client was refused."""
    with serving(tmp_path, clock, max_connections=8, max_connections_per_address=3) as server:
        with ExitStack() as stack:
            flood = [stack.enter_context(connect(server, "native", "127.0.0.2")) for _ in range(10)]
            refusals = [received(sock) for sock in flood[3:]]  # refused at once, each with its error
            assert all(b"too_many_connections" in refusal and PER_ADDRESS.encode() in refusal
                       for refusal in refusals)
            assert open_count(server) == 3
            assert served(server, "127.0.0.3")  # another address is served meanwhile
            assert stomp_connect(server, "127.0.0.3") == ""
        wait_until(lambda: open_count(server) == 0, "the flood's connections to close")
        assert served(server, "127.0.0.2")  # its connections closed, the address is served again
        assert refused(server, "per_address") == 7 and refused(server, "max_connections") == 0


def test_the_cap_counts_both_listeners_and_refuses_each_with_its_protocols_error(tmp_path, clock) -> None:
    with serving(tmp_path, clock, max_connections_per_address=3) as server:
        with held(server, ["native", "stomp", "native"], "127.0.0.2"):
            error = native_refusal(server, "127.0.0.2")
            assert error["code"] == "too_many_connections"
            assert error["message"] == ("127.0.0.2 already holds 3 connections, its max_connections_per_address=3;"
                                        " close some, or ask for an override for this address")
            message = stomp_connect(server, "127.0.0.2")
            assert message.startswith("too_many_connections: 127.0.0.2 already holds 3 connections")
            client = ClientFrom(native(server), "127.0.0.2", user="app", password=PASSWORD)
            with pytest.raises(BrokerUnavailableError, match="closed the connection: too_many_connections: "
                               "127.0.0.2 already holds 3 connections"):
                client.topics()
            client.close()
            assert served(server, "127.0.0.3")
        assert refused(server, "per_address") == 3


def test_an_override_gives_an_address_a_cap_of_its_own(tmp_path, clock) -> None:
    """A load balancer's address carries many clients' connections; the most specific override wins."""
    overrides = {"127.0.0.4": 6, "127.0.0.0/24": 2}
    with serving(tmp_path, clock, max_connections_per_address=4,
                 max_connections_per_address_overrides=overrides) as server:
        with held(server, ["native", "stomp"] * 3, "127.0.0.4"):
            assert native_refusal(server, "127.0.0.4")["message"].endswith(
                "its max_connections_per_address=6; close some, or ask for an override for this address")
        with held(server, ["native", "stomp"], "127.0.0.5"):  # in 127.0.0.0/24: 2
            assert "max_connections_per_address=2" in stomp_connect(server, "127.0.0.5")
        with held(server, ["native"] * 4, "127.0.1.5"):  # in no override: the default, 4
            assert "max_connections_per_address=4" in native_refusal(server, "127.0.1.5")["message"]


def test_refusals_are_logged_once_per_address_per_interval_and_all_counted(tmp_path, clock) -> None:
    with serving(tmp_path, clock, max_connections=3, max_connections_per_address=1) as server, \
            capture_logs() as logs, held(server, ["native"], "127.0.0.2"), held(server, ["stomp"], "127.0.0.3"):
        for _ in range(20):
            native_refusal(server, "127.0.0.2")
        native_refusal(server, "127.0.0.3")
        clock.advance(REFUSALS_LOGGED_EVERY)
        for _ in range(5):
            native_refusal(server, "127.0.0.2")
        with held(server, ["native"], "127.0.0.4"):  # the server is full now: the global cap refuses
            for _ in range(10):
                assert native_refusal(server, "127.0.0.5")["message"] == (
                    "the broker already holds max_connections=3")
        assert refused(server, "per_address") == 26 and refused(server, "max_connections") == 10
    lines = [(e["address"], e["reason"], e["refused"]) for e in logs if e["event"] == "connection_refused"]
    assert lines == [("127.0.0.2", "per_address", 1), ("127.0.0.3", "per_address", 1),
                     ("127.0.0.2", "per_address", 20), ("*", "max_connections", 1)]


def test_tls_connections_are_capped_before_their_handshake_and_must_finish_it_in_time(tmp_path, clock) -> None:
    """asyncio hands a TLS connection over once its handshake is done, and allows a handshake 60 s:
    connections that never sent a ClientHello were counted by no cap, and held for a minute."""
    cert, key = self_signed(tmp_path)
    tls = TlsConfig(str(cert), str(key))
    with serving(tmp_path, clock, tls=tls, max_connections_per_address=3, handshake_timeout=1.0) as server:
        with held(server, ["native", "stomp", "native"], "127.0.0.2"):  # no ClientHello: counted already
            for listener in ("native", "stomp"):
                with connect(server, listener, "127.0.0.2") as sock:
                    assert received(sock) == b""  # closed unread: an error needs a handshake first
            client = Client(native(server), user="app", password=PASSWORD,
                            tls=ssl.create_default_context(cafile=str(cert)))
            assert isinstance(client.topics(), list)  # another address is served over TLS
            client.close()
        assert refused(server, "per_address") == 2
        with connect(server, "native", "127.0.0.2") as sock:  # silent: cut at handshake_timeout
            assert received(sock) == b""
        assert counted(server.metrics.timeouts, listener="native", reason="handshake") == 1


def test_the_metrics_listener_holds_a_few_connections_however_many_are_opened(tmp_path, clock) -> None:
    """Each connection to /metrics waited 10 s for its request, and nothing capped them: one client
    could hold file descriptors by the thousand, in the broker's own process."""
    with serving(tmp_path, clock) as server, ExitStack() as stack:
        for _ in range(3 * METRICS_CONNECTIONS):
            stack.enter_context(connect(server, "metrics", "127.0.0.2"))  # silent: no request
        with connect(server, "metrics", "127.0.0.3") as sock:  # another address still scrapes
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: broker\r\n\r\n")
            assert received(sock).startswith(b"HTTP/1.1 200 OK")
        assert counted(server.metrics.refused, listener="metrics") == 3 * METRICS_CONNECTIONS - METRICS_PER_ADDRESS
        wait_until(lambda: held_by(server.port("metrics")) <= METRICS_PER_ADDRESS,
                   "the refused connections to be closed")


def held_by(port: int) -> int:
    """The connections the server side of ``port`` holds open (``ss``)."""
    listing = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
    return len(listing.splitlines())


def test_an_ipv6_client_counts_as_its_64_and_a_mapped_ipv4_as_its_ipv4(clock) -> None:
    """One client usually holds a whole IPv6 /64: counted by address, it could open a connection
    from each of 2**64. (Only ::1 is this machine's, so this one runs on the admission alone.)"""
    admission = Admission(Limits(max_connections_per_address=2), ServerMetrics(), clock)
    assert [admission.admit("native", host) is None for host in (
        "2001:db8::1", "2001:db8::2", "2001:db8::ffff:3", "2001:db8:0:1::1")] == [True, True, False, True]
    assert [admission.admit("stomp", host) is None for host in (
        "10.0.0.1", "::ffff:10.0.0.1", "10.0.0.1", "fe80::1%eth0", "fe80::2%eth1")] == [True, True, False, True, True]
    assert all(admission.admit("native", None) is None for _ in range(10))  # a unix socket's: no address
    admission.release("2001:db8::1")
    assert admission.admit("native", "2001:db8::99") is None
