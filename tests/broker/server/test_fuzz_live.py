"""Live fuzzing of the STOMP listener: mutated and random frames, slow and half-open connections.

Hypothesis builds streams from valid frames (CONNECT, SUBSCRIBE, SEND, ACK,
BEGIN, COMMIT, ...), mutates them (bytes flipped, inserted, cut) or replaces
them with random bytes, and sends them in arbitrary chunks to a server
process. The user may consume but not produce, so no stream can store
anything: after each example the stored messages are unchanged, the server
logged no internal error, and a real client is still served. The CI run
runs examples for about a minute (``FUZZ_SECONDS``), the ``soak`` run for half an hour
(``FUZZ_SOAK_SECONDS``); examples past the budget (or the example count) return at once.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerUnavailableError
from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_stomp_errors import frame
from tests.passwords import hash_password

BUDGET = float(os.environ.get("FUZZ_SECONDS", "60"))  # seconds of examples in CI
SOAK_BUDGET = float(os.environ.get("FUZZ_SOAK_SECONDS", "1800"))

VALID = [
    frame("CONNECT", {"accept-version": "1.0,1.1,1.2", "login": "reader", "passcode": "r3ad",
                      "heart-beat": "0,0"}),
    frame("STOMP", {"accept-version": "1.2", "login": "reader", "passcode": "r3ad"}),
    frame("SUBSCRIBE", {"destination": "/queue/kept", "id": "1", "ack": "client-individual",
                        "activemq.prefetchSize": "2"}),
    frame("SUBSCRIBE", {"destination": "/topic/kept", "id": "2", "ack": "client"}),
    frame("SEND", {"destination": "/queue/kept", "content-length": "3"}, b"a\0b"),
    frame("SEND", {"destination": "/queue/kept", "transaction": "t"}, b"x"),
    frame("ACK", {"id": "session-1-1"}), frame("NACK", {"id": "session-1-2"}),
    frame("BEGIN", {"transaction": "t"}), frame("COMMIT", {"transaction": "t"}),
    frame("ABORT", {"transaction": "t"}), frame("UNSUBSCRIBE", {"id": "1"}),
    frame("DISCONNECT", {"receipt": "bye"}), b"\n", b"\r\n",
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """Valid frames in any order, then bytes flipped, inserted or cut."""
    data = bytearray(b"".join(draw(st.lists(st.sampled_from(VALID), min_size=1, max_size=8))))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(data)))
        change = draw(st.sampled_from(["flip", "insert", "cut"]))
        if change == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif change == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from(
                [b":", b"\\", b"\0", b"\n\n", b"content-length:99999999999999999999\n", "²".encode()]))
        else:
            del data[at:at + draw(st.integers(1, 16))]
    return bytes(data)


streams = mutated() | st.binary(max_size=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("fuzz-live")
    settings_file = folder / "reliable.toml"
    settings_file.write_text(
        "[broker]\nhandshake_timeout = 1\nidle_timeout = 1\n"
        f'[broker.users.reader]\npassword_hash = "{hash_password("r3ad")}"\n'
        'produce = []\nconsume = ["*"]\ngroups = ["*"]\n'
        f'[broker.users.admin]\npassword_hash = "{hash_password("adm1n")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n')
    started = ServerProcess(folder / "data", "--settings", str(settings_file)).start()
    client = admin(started)
    client.publish("kept", [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(5)])
    client.close()
    yield started
    started.stop()


def admin(server: ServerProcess) -> Client:
    return Client(server.url, user="admin", password="adm1n")


def stored(server: ServerProcess) -> list[tuple[str, bytes]]:
    """What topic ``kept`` holds, read through the native port.

    The server's ``idle_timeout`` is 1 s (so fuzzed connections end fast), which
    may cut this reader between two of its requests on a loaded machine: the
    client then reconnects, and the read is asked again.
    """
    client = admin(server)
    try:
        for attempt in Retrying(retry=retry_if_exception_type(BrokerUnavailableError),
                                stop=stop_after_attempt(5), reraise=True):
            with attempt:
                return sorted((d.message_id, d.body) for q in range(4)
                              for d in client.read("kept", q, 0, 100))
        raise AssertionError("unreachable")
    finally:
        client.close()


def play(server: ServerProcess, stream: bytes, cuts: list[int], half_open: bool) -> None:
    """Send ``stream`` cut at ``cuts``; read every reply until the server ends the connection."""
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    with socket.create_connection(("127.0.0.1", server.stomp_port), timeout=30) as sock:
        try:
            for a, b in itertools.pairwise(points):
                sock.sendall(stream[a:b])
            if not half_open:
                half_close(sock)
            while sock.recv(65536):  # half open: the server's deadlines end it
                pass
        except ConnectionError:
            pass


def half_close(sock: socket.socket) -> None:
    """End our side of ``sock``; the server may have ended the connection already (ENOTCONN)."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise


def check_serving(server: ServerProcess, before: list[tuple[str, bytes]]) -> None:
    assert stored(server) == before
    log = server.log.read_text()
    assert "session_failed" not in log and "Traceback" not in log
    assert server.running


class Budget:
    """Examples run until ``seconds`` have passed since the first; later ones return at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.ends: float | None = None
        self.ran = 0

    def spent(self) -> bool:
        now = time.monotonic()
        self.ends = self.ends if self.ends is not None else now + self.seconds
        self.ran += now < self.ends
        return now >= self.ends


CI_BUDGET, SOAK = Budget(BUDGET), Budget(SOAK_BUDGET)


def fuzz(server: ServerProcess, stream: bytes, cuts: list[int], half_open: bool,
         budget: Budget) -> None:
    if budget.spent():
        return
    before = stored(server)
    play(server, stream, cuts, half_open)
    check_serving(server, before)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(stream=streams, cuts=st.lists(st.integers(0, 1000), max_size=6), half_open=st.booleans())
def test_mutated_stomp_streams_leave_the_server_serving_and_the_store_unchanged(
        server, stream, cuts, half_open) -> None:
    fuzz(server, stream, cuts, half_open, CI_BUDGET)


@pytest.mark.soak
@settings(max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(stream=streams, cuts=st.lists(st.integers(0, 1000), max_size=12), half_open=st.booleans())
def test_soak_mutated_stomp_streams(server, stream, cuts, half_open) -> None:
    fuzz(server, stream, cuts, half_open, SOAK)


def test_many_half_open_and_slow_connections_at_once_then_a_client_is_served(server) -> None:
    """Half a CONNECT on 30 connections that then stop sending: all cut at the deadline."""
    before = stored(server)
    sockets = [socket.create_connection(("127.0.0.1", server.stomp_port), timeout=30) for _ in range(30)]
    try:
        for n, sock in enumerate(sockets):
            sock.sendall(VALID[0][: 5 + n])
        for sock in sockets:
            while True:  # the server ends each one: no reply, just the end
                try:
                    if not sock.recv(65536):
                        break
                except ConnectionError:
                    break
    finally:
        for sock in sockets:
            sock.close()
    check_serving(server, before)
