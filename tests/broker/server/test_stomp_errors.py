"""Bad STOMP input over a raw socket: an ERROR frame, then a closed connection, the store unchanged.

The server here requires credentials and allows 64 KiB frames. Each test
looks at the store afterwards through a real client (stomp.py) to show that
nothing was added, and the server still serves.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_stomp import WAIT, connect
from tests.passwords import hash_password

MAX_FRAME = 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("stomp-errors")
    settings = folder / "reliable.toml"
    settings.write_text(
        f"[broker]\nmax_frame_size = {MAX_FRAME}\n"
        f'[broker.users.app]\npassword_hash = "{hash_password("s3cret")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def frame(command: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [command, *(f"{k}:{v}" for k, v in headers.items())]
    return ("\n".join(lines) + "\n\n").encode() + body + b"\0"


def login() -> bytes:
    return frame("CONNECT", {"accept-version": "1.2", "host": "/", "login": "app", "passcode": "s3cret"})


def exchange(server: ServerProcess, *chunks: bytes) -> list[bytes]:
    """Send ``chunks``; every frame the server sent until it closed the connection."""
    with socket.create_connection(("127.0.0.1", server.stomp_port), timeout=WAIT) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
        received = b""
        while data := sock.recv(65536):  # a closed connection ends this; a hang fails on WAIT
            received += data
    return [f for f in received.split(b"\0") if f.strip(b"\r\n")]


def queue_contents(server: ServerProcess, destination: str, expected: int) -> list[str]:
    """What the queue holds: waits for ``expected`` messages, then looks once more."""
    connection, inbox = connect(server)
    connection.subscribe(destination, id="1", ack="client-individual")
    inbox.wait_for(expected)
    connection.send(destination, "marker", receipt="marker")  # everything before it is delivered
    messages = inbox.wait_for(expected + 1)
    connection.disconnect()
    bodies = [m.body for m in messages]
    assert bodies[-1] == "marker"
    return bodies[:-1]


@pytest.mark.parametrize(("name", "bad", "reason"), [
    ("unknown command", frame("FROB", {"destination": "/queue/{q}"}), "unknown STOMP command"),
    ("header without colon", b"SEND\ndestination:/queue/{q}\nbroken header\n\nx\0", "header"),
    ("no destination", frame("SEND", {}, b"x"), "destination"),
    ("bad destination", frame("SEND", {"destination": "/elsewhere/{q}"}, b"x"), "destination"),
    ("content-length without NUL", b"SEND\ndestination:/queue/{q}\ncontent-length:1\n\nxy\0", "NUL"),
    ("ack of nothing", frame("ACK", {"id": "nothing"}), "ack"),
    ("commit of no transaction", frame("COMMIT", {"transaction": "t9"}), "transaction"),
])
def test_a_malformed_frame_gets_error_then_close_and_the_store_is_unchanged(
        server, unique, name, bad, reason) -> None:
    destination = f"/queue/{unique}"
    sender, _ = connect(server)
    sender.send(destination, "before", receipt="stored")
    frames = exchange(server, login(), bad.replace(b"{q}", unique.encode()),
                      frame("SEND", {"destination": destination}, b"after the error"))
    assert frames[0].startswith(b"CONNECTED")
    assert len(frames) == 2 and frames[1].startswith(b"ERROR"), (name, frames)
    assert reason.lower() in frames[1].decode(errors="replace").lower(), (name, frames[1])
    assert queue_contents(server, destination, 1) == ["before"]  # nothing of the bad connection
    sender.disconnect()


def test_an_oversized_frame_is_refused_before_its_body_is_sent(server, unique) -> None:
    destination = f"/queue/{unique}"
    headers = f"SEND\ndestination:{destination}\ncontent-length:{10 * MAX_FRAME}\n\n".encode()
    frames = exchange(server, login(), headers)  # no body at all: the ERROR cannot wait for it
    assert frames[1].startswith(b"ERROR") and len(frames) == 2
    assert queue_contents(server, destination, 0) == []


def test_a_client_without_credentials_reads_nothing(server, unique) -> None:
    destination = f"/queue/{unique}"
    sender, _ = connect(server)
    sender.send(destination, "secret", receipt="stored")
    anonymous = frame("CONNECT", {"accept-version": "1.2", "host": "/"})
    subscribe = frame("SUBSCRIBE", {"destination": destination, "id": "1", "ack": "auto"})
    frames = exchange(server, anonymous, subscribe)
    assert len(frames) == 1 and frames[0].startswith(b"ERROR") and b"credentials" in frames[0]
    assert queue_contents(server, destination, 1) == ["secret"]  # still there, unread
    sender.disconnect()


def test_the_server_beats_and_drops_a_client_that_promised_beats_and_went_silent(server) -> None:
    promise = frame("CONNECT", {"accept-version": "1.2", "host": "/", "login": "app",
                                "passcode": "s3cret", "heart-beat": "1000,1000"})
    with socket.create_connection(("127.0.0.1", server.stomp_port), timeout=WAIT) as sock:
        sock.sendall(promise)
        received = b""
        while data := sock.recv(65536):  # never beating: the server must close (2 intervals)
            received += data
    connected, _, after = received.partition(b"\0")
    assert connected.startswith(b"CONNECTED") and b"heart-beat:1000,1000" in connected
    assert after and after.strip(b"\r\n") == b""  # the server's heart-beats: EOLs only
