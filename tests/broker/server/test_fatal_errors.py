"""A client told of a fatal error gets to read it, though it was still sending.

The server closed the connection right after its error frame, with the client's bytes unread; the
kernel then sends a reset instead of a FIN, and a reset can destroy data the client has not read
yet: a client streaming a frame past ``max_frame_size`` saw "connection reset" and never the
``frame_too_large`` that said why. Now the server half-closes after a fatal error and reads (and
drops) what still comes, for a moment, before it closes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.protocol import codec as native_codec
from broker.protocol.codec import FrameDecoder, decode_body
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded

MAX_FRAME = 64 * 1024
STREAMED = 4 * 1024 * 1024  # what the client sends after the refused announcement


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, max_frame_size=MAX_FRAME) as started:
        yield started


def received(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 20):  # a reset raises here: the test fails
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_native_client_streaming_an_oversized_frame_reads_frame_too_large(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port("native")), timeout=30) as sock:
        sock.sendall(native_codec.PREFIX.pack(STREAMED + 1, native_codec.VERSION) + b"x" * STREAMED)
        [frame] = FrameDecoder(1 << 20).feed(received(sock))
    error = decode_body(frame)
    assert (error["fatal"], error["error"]["code"]) == (True, "frame_too_large")


def test_a_stomp_client_streaming_an_oversized_frame_reads_its_error(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port("stomp")), timeout=30) as sock:
        sock.sendall(b"CONNECT\naccept-version:1.2\n\n\0")
        connected = sock.recv(65536)
        assert connected.startswith(b"CONNECTED")
        sock.sendall(f"SEND\ndestination:/queue/q\ncontent-length:{STREAMED}\n\n".encode() + b"x" * STREAMED)
        error = received(sock)
    assert error.startswith(b"ERROR\n") and b"frame_too_large" in error
