"""Hostile STOMP clients against a server process with users: deadlines, bounds, strict numbers.

Each test plays what an attacker would send over a raw socket and shows the
server's answer: a connection cut at the handshake deadline whatever it
sends, a transaction refused before it grows, a SEND of an unpermitted topic
refused before it is buffered, metric labels from a fixed set, and an ERROR
frame naming the header of a number that is not one.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_stomp import WAIT
from tests.broker.server.test_stomp_errors import exchange, frame, queue_contents
from tests.passwords import hash_password

HANDSHAKE = 1.0
IDLE = 5.0
MAX_TRANSACTION_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("stomp-hostile")
    settings = folder / "reliable.toml"
    settings.write_text(
        f"[broker]\nhandshake_timeout = {HANDSHAKE}\nidle_timeout = {IDLE}\nmetrics_port = 0\n"
        f"max_transaction_bytes = {MAX_TRANSACTION_BYTES}\nmax_transactions = 2\n"
        f'[broker.users.app]\npassword_hash = "{hash_password("s3cret")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n'
        f'[broker.users.reader]\npassword_hash = "{hash_password("r3ad")}"\n'
        'produce = []\nconsume = ["*"]\ngroups = ["*"]\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def login(user: str = "app", passcode: str = "s3cret") -> bytes:
    return frame("CONNECT", {"accept-version": "1.2", "host": "/", "login": user, "passcode": passcode})


def metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=WAIT) as page:
        return str(page.read().decode())


def test_a_connection_that_trickles_bytes_is_cut_at_the_handshake_deadline(server) -> None:
    """One newline every 0.2 s kept the connection open forever; the deadline holds anyway."""
    started = time.monotonic()
    trickled = 0
    with socket.create_connection(("127.0.0.1", server.stomp_port), timeout=WAIT) as sock:
        sock.settimeout(0.2)
        while time.monotonic() - started < WAIT:
            try:
                if sock.recv(1024) == b"":
                    break
            except TimeoutError:
                sock.sendall(b"\n")
                trickled += 1
            except ConnectionResetError:
                break
        else:
            pytest.fail(f"the connection was still open after {WAIT} s of trickled newlines")
    assert trickled >= 3  # the trickle really ran past what a single idle timeout would allow
    assert time.monotonic() - started < HANDSHAKE + 5


def test_a_connect_sent_a_byte_at_a_time_past_the_deadline_is_cut(server) -> None:
    hello = login()
    with socket.create_connection(("127.0.0.1", server.stomp_port), timeout=WAIT) as sock:
        sock.settimeout(0.2)
        received, sent = b"", 0
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # cut with bytes unread: reset
            while sent < len(hello):
                try:
                    data = sock.recv(1024)
                    if not data:
                        break
                    received += data
                except TimeoutError:
                    sock.sendall(hello[sent:sent + 1])
                    sent += 1
    assert sent < len(hello)
    assert b"CONNECTED" not in received


def test_a_promise_of_rare_heart_beats_does_not_outlast_the_idle_timeout(server) -> None:
    """A client promising a beat a day would have held its connection for two days, silent."""
    hello = frame("CONNECT", {"accept-version": "1.2", "login": "app", "passcode": "s3cret",
                              "heart-beat": "86400000,0"})
    received = b""
    with socket.create_connection(("127.0.0.1", server.stomp_port), timeout=WAIT) as sock:
        sock.sendall(hello)
        while data := sock.recv(65536):  # the server ends it; a hang fails on WAIT (> IDLE)
            received += data
    assert received.startswith(b"CONNECTED")


def test_made_up_commands_never_become_metric_labels(server, unique) -> None:
    made_up = [f"FROB{unique.replace('-', '').upper()}{n}" for n in range(5)]
    made_up = ["".join(c for c in name if c.isalpha()) + "X" * n for n, name in enumerate(made_up)]
    for command in made_up:
        exchange(server, frame(command, {}))
    for command in made_up:
        exchange(server, login(), frame(command, {}))
    page = metrics(server)
    assert 'command="unknown"' in page
    for command in made_up:
        assert command[:16] not in page


def test_a_send_without_produce_right_is_refused_before_it_is_buffered(server, unique) -> None:
    destination = f"/queue/{unique}"
    frames = exchange(server, login("reader", "r3ad"), frame("BEGIN", {"transaction": "t"}),
                      frame("SEND", {"destination": destination, "transaction": "t"}, b"x" * 1000),
                      frame("SEND", {"destination": destination, "transaction": "t"}, b"y"))
    assert frames[0].startswith(b"CONNECTED")
    assert len(frames) == 2 and frames[1].startswith(b"ERROR")
    assert b"permission" in frames[1].lower() or b"produce" in frames[1]


def test_a_transaction_past_its_bound_is_refused_and_nothing_is_published(server, unique) -> None:
    destination = f"/queue/{unique}"
    body = b"z" * 8192
    sends = [frame("SEND", {"destination": destination, "transaction": "t"}, body)
             for _ in range(MAX_TRANSACTION_BYTES // len(body) + 2)]
    frames = exchange(server, login(), frame("BEGIN", {"transaction": "t"}), *sends,
                      frame("COMMIT", {"transaction": "t"}))
    assert frames[-1].startswith(b"ERROR") and b"max_transaction_bytes" in frames[-1]
    assert queue_contents(server, destination, 0) == []


def test_open_transactions_per_connection_are_bounded(server) -> None:
    frames = exchange(server, login(), *(frame("BEGIN", {"transaction": f"t{n}"}) for n in range(3)))
    assert frames[-1].startswith(b"ERROR") and b"max_transactions" in frames[-1]


@pytest.mark.parametrize(("header", "value"), [
    ("content-length", "\u00b2"), ("content-length", "9" * 4301), ("content-length", "+5"),
    ("content-length", " 5"), ("heart-beat", "\u00b2,0"), ("heart-beat", "0," + "9" * 4301),
    ("activemq.prefetchSize", "\u00b9"), ("activemq.prefetchSize", "9" * 4301),
])
def test_a_number_that_is_not_one_gets_an_error_naming_the_header(server, unique, header, value) -> None:
    destination = f"/queue/{unique}"
    logged = len(server.log.read_text())
    if header == "heart-beat":
        frames = exchange(server, frame("CONNECT", {"accept-version": "1.2", "login": "app",
                                                    "passcode": "s3cret", header: value}))
    elif header == "content-length":
        frames = exchange(server, login(), frame("SEND", {"destination": destination, header: value}, b"x"))
    else:
        frames = exchange(server, login(), frame("SUBSCRIBE", {"destination": destination, "id": "1",
                                                               header: value}))
    assert frames and frames[-1].startswith(b"ERROR")
    assert header.encode() in frames[-1]
    assert queue_contents(server, destination, 0) == []
    assert "Traceback" not in server.log.read_text()[logged:]
