"""Before a client has authenticated, a frame may be only ``max_handshake_frame_size`` bytes.

Without it an unauthenticated connection could announce a frame of ``max_frame_size`` (8 MiB)
and have the server buffer it, on every connection the caps allow, for ``handshake_timeout``
each time: memory for anyone who can open a socket. Kafka bounds what it reads before
authentication the same way (``sasl.server.max.receive.size``). A client that sends its hello or
CONNECT and then large frames at once, without waiting for the answer, still works.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp

from broker.protocol import codec as native_codec
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.threaded import counted, replies
from tests.passwords import hash_password
from tests.waiting import wait_until

PASSWORD = "s3cret"
USERS = {"app": {"password_hash": hash_password(PASSWORD), "admin": True}}
HANDSHAKE_FRAME = 4096
BIG = 1024 * 1024  # far under max_frame_size, far over the handshake's


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), USERS, max_handshake_frame_size=HANDSHAKE_FRAME,
                          handshake_timeout=20) as started:
        yield started


def native_socket(server: BrokerServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port("native")), timeout=30)


def publish(unique: str, request_id: int, body: bytes) -> bytes:
    return native_codec.encode({"id": request_id, "op": "publish", "topic": unique,
                                "messages": {"count": 1, "same": {"body": body}, "columns": {}}})


def hello(request_id: int = 1) -> bytes:
    return native_codec.encode({"id": request_id, "op": "hello", "user": "app", "password": PASSWORD})


def test_a_large_frame_before_hello_is_refused_from_its_length_prefix(server) -> None:
    with native_socket(server) as sock:
        sock.sendall(native_codec.PREFIX.pack(BIG, native_codec.VERSION))  # announces 1 MiB, sends none
        [error] = replies(sock, 1)
        assert sock.recv(1) == b""  # and closed
    assert error["fatal"] and error["error"]["code"] == "frame_too_large"
    assert error["error"]["message"] == f"frame of {BIG} bytes exceeds max_handshake_frame_size {HANDSHAKE_FRAME}"


def test_a_client_that_pipelines_large_frames_behind_its_hello_is_served(server, unique) -> None:
    with native_socket(server) as sock:
        sock.sendall(hello() + publish(unique, 2, b"x" * BIG) + publish(unique, 3, b"y" * BIG))
        answered = replies(sock, 3)
        sock.sendall(publish(unique, 4, b"z" * BIG))  # and later ones, alone
        answered += replies(sock, 1)
    assert [(reply["id"], reply["ok"]) for reply in answered] == [(1, True), (2, True), (3, True), (4, True)]


def test_a_large_frame_before_hello_in_the_same_chunk_as_small_requests_is_refused(server, unique) -> None:
    """The limit holds for every frame before the hello, not only the first."""
    with native_socket(server) as sock:
        big = publish(unique, 2, b"x" * BIG)  # its announcement only: unread bytes would reset the connection
        sock.sendall(native_codec.encode({"id": 1, "op": "ping"}) + big[:HANDSHAKE_FRAME])
        answered = replies(sock, 2)
    assert [(reply["ok"], reply["error"]["code"]) for reply in answered] == [(False, "frame_too_large")]


def stomp_frame(command: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    return ("\n".join([command, *(f"{k}:{v}" for k, v in headers.items())]) + "\n\n").encode() + body + b"\0"


def test_a_stomp_frame_before_connect_is_refused_past_the_handshake_limit(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port("stomp")), timeout=30) as sock:
        connect = stomp_frame("CONNECT", {"accept-version": "1.2", "login": "app", "passcode": PASSWORD,
                                          "padding": "p" * BIG})
        sock.sendall(connect[:2 * HANDSHAKE_FRAME])  # unread bytes would reset the connection
        received = b""
        while data := sock.recv(65536):
            received += data
    assert received.startswith(b"ERROR\n")
    assert (b"\nmessage:frame_too_large\\c STOMP frame of at least 8192 bytes exceeds "
            b"max_handshake_frame_size 4096\n") in received  # \c: a colon, escaped


def test_after_connect_a_stomp_client_sends_large_frames(server, unique) -> None:
    connection = stomp.Connection12([("127.0.0.1", server.port("stomp"))])
    receipts: list[str] = []
    connection.set_listener("receipts", type("Receipts", (stomp.ConnectionListener,), {
        "on_receipt": lambda self, frame: receipts.append(frame.headers["receipt-id"])})())
    connection.connect("app", PASSWORD, wait=True)
    connection.send(f"/queue/{unique}", b"b" * BIG, headers={"receipt": "r1"})
    wait_until(lambda: receipts == ["r1"], "the receipt of the large SEND")
    connection.disconnect()


def test_a_hello_trickled_a_byte_at_a_time_is_cut_at_the_handshake_deadline(tmp_path) -> None:
    """Each byte came well within idle_timeout; the deadline counts from the accept anyway, and the
    cut is counted as a handshake timeout (it was counted as idle)."""
    with threaded.serving(tmp_path, FakeClock(), USERS, handshake_timeout=0.5, idle_timeout=30) as server:
        trickled = hello()
        with native_socket(server) as sock:
            sock.settimeout(0.05)
            sent = 0
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                while sent < len(trickled):
                    try:
                        if sock.recv(1024) == b"":
                            break  # cut
                    except TimeoutError:
                        sock.sendall(trickled[sent:sent + 1])
                        sent += 1
        assert sent < len(trickled)  # cut before the hello was whole: 20 bytes a second take longer
        wait_until(lambda: counted(server.metrics.timeouts, listener="native", reason="handshake") == 1,
                   "the cut counted as a handshake timeout")


def test_a_request_before_hello_is_refused_and_the_connection_closed(server) -> None:
    """Each request before hello was answered and the next one read, for handshake_timeout: a client
    that never logs in had the server decode and answer requests at full speed meanwhile. Kafka too
    disconnects a client that sends anything but its authentication first."""
    pings = b"".join(native_codec.encode({"id": n, "op": "ping"}) for n in range(1, 1001))
    with native_socket(server) as sock:
        sock.sendall(pings)
        answered = replies(sock, 1000)
    assert [(r["id"], r["fatal"], r["error"]["code"]) for r in answered] == [(1, True, "unauthenticated")]
