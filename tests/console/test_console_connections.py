"""The console's listener against hostile or broken HTTP clients (`broker.console.listener`).

uvicorn held a socket that sent nothing, or half a request a byte at a time,
for ever, and capped no connections: one client could take every file
descriptor of the process the console serves from (the broker server's: 1100
silent sockets to the console of a server allowed 1024 left its publishes
unanswered and its store failing), and a log-in form of any size was read
whole, its multipart files spooled to disk. Clients come from other loopback
addresses (127.0.0.2 and up) so the per-address bound can be seen; as in
`tests.framework.test_probe_limits`, whose helpers these are.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable, Iterator

import pytest

from broker.console.config import ConsoleConfig
from broker.console.listener import MAX_BODY, MAX_HEAD
from broker.console.serving import ConsoleServer, start_console
from broker.errors import BrokerConfigError
from broker.server.auth import Authenticator, load_users
from tests.broker.server.test_connection_caps import held_by
from tests.console.http import Visitor
from tests.framework.test_health import eventually
from tests.framework.test_probe_limits import open_ones, silent
from tests.passwords import hash_password

DEFAULTS = ConsoleConfig()
LOGIN = b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.fixture
def console() -> Iterator[Callable[..., ConsoleServer]]:
    """Starts a console with users (its log-in form open to anyone) and the settings given."""
    users = Authenticator(load_users({"alice": {"password_hash": hash_password("alice-pw"), "admin": True}}))
    started: list[ConsoleServer] = []

    def start(**settings: object) -> ConsoleServer:
        started.append(start_console(ConsoleConfig(port=0, **settings), users, None))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for server in started:
        server.stop()


def address(server: ConsoleServer) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


def closing(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def test_silent_sockets_of_one_address_leave_the_console_to_everyone_else(console) -> None:
    server = console(request_timeout=600.0)
    hostile = silent(address(server), "127.0.0.2", 200)
    try:
        eventually(lambda: len(open_ones(hostile)) == DEFAULTS.max_connections_per_address,
                   "all but the address's cap closed unread", 30)
        assert Visitor(server.url, source="127.0.0.3").get("/login")[0] == 200
    finally:
        closing(hostile)


def test_the_console_holds_at_most_its_connections_in_all(console) -> None:
    server = console(request_timeout=600.0, max_connections=8, max_connections_per_address=4)
    sockets = [sock for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5") for sock in silent(address(server), source, 4)]
    try:
        eventually(lambda: len(open_ones(sockets)) == 8, "held no more than the cap in all", 30)
    finally:
        closing(sockets)


def test_a_trusted_proxy_holds_up_to_the_cap_in_all(console) -> None:
    """Every client behind a proxy shares its address: only the cap in all applies to it."""
    server = console(request_timeout=600.0, max_connections=8, max_connections_per_address=2,
                     trusted_proxies=["127.0.0.6"])
    sockets = silent(address(server), "127.0.0.6", 10)
    try:
        eventually(lambda: len(open_ones(sockets)) == 8, "the proxy held the cap in all", 30)
    finally:
        closing(sockets)


def test_a_request_is_cut_at_its_deadline_however_it_trickles_in(console) -> None:
    """From the accept, and on a kept-alive connection from the end of the previous response: uvicorn
    waited for ever before a first request, and any byte cancelled its keep-alive timer."""
    server = console(request_timeout=0.5)
    (quiet,) = silent(address(server), "127.0.0.1", 1)
    slow = socket.create_connection(address(server))
    slow.sendall(LOGIN.replace(b"POST", b"GET") + b"X-Slow: ")  # then a byte at a time
    kept = socket.create_connection(address(server))
    kept.sendall(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert whole_response(kept).startswith(b"HTTP/1.1 200")  # kept alive: then the next request's first byte
    kept.sendall(b"G")
    clients = [quiet, slow, kept]

    def all_cut() -> bool:
        try:
            slow.send(b"a")
        except OSError:
            pass
        return not open_ones(clients)

    try:
        eventually(all_cut, "every connection closed at its deadline", 30)
        assert Visitor(server.url).get("/login")[0] == 200
    finally:
        closing(clients)


def test_a_client_that_reads_nothing_is_cut_once_its_responses_fill_the_buffers(console) -> None:
    """Requests pipelined and their responses left unread: uvicorn waited for room for ever."""
    server = console(request_timeout=0.5)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(server))
    sock.setblocking(False)
    try:
        while True:  # until the console stops reading: its answers have nowhere to go
            sock.send(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 100)
    except BlockingIOError:
        pass
    try:
        eventually(lambda: held_by(server.port) == 0, "the connection cut", 30)
    finally:
        sock.close()


def test_a_body_over_the_limit_is_refused_as_it_comes(console) -> None:
    """Starlette read a log-in form whole before any check: 1000 fields of 1 MiB in memory, or
    multipart files of any size spooled to disk."""
    server = console()
    size = 4 * MAX_BODY
    part = b'--b\r\nContent-Disposition: form-data; name="f"; filename="f"\r\n\r\n'
    declared = (LOGIN + b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: %d\r\n\r\n"
                % (len(part) + size + 8) + part)
    chunk = b"a" * 65536
    assert post(server, declared, [chunk] * (size // len(chunk)), b"\r\n--b--\r\n").startswith(b"HTTP/1.1 413")
    chunked = LOGIN + b"Content-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n"
    fields = [b"%x\r\n" % len(chunk) + b"f=" + chunk[2:] + b"\r\n"] * (size // len(chunk))
    assert post(server, chunked, fields, b"0\r\n\r\n").startswith(b"HTTP/1.1 413")
    assert Visitor(server.url).get("/login")[0] == 200


def test_a_head_over_the_limit_is_refused(console) -> None:
    """h11's bound, pinned: a request line and headers of up to 16 KiB."""
    server = console()
    with socket.create_connection(address(server)) as sock:
        try:
            sock.sendall(LOGIN + b"X-Big: " + b"a" * (4 * MAX_HEAD))
        except OSError:
            pass
        assert answer(sock).startswith(b"HTTP/1.1 400")


def test_a_whole_head_over_the_limit_is_refused(console) -> None:
    """h11 bounds only an unfinished head: a whole one of 32 KiB arriving in one read was served."""
    server = console()
    head = b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    with socket.create_connection(address(server)) as sock:
        sock.sendall(head + b"a" * (2 * MAX_HEAD) + b"\r\n\r\n")
        assert answer(sock).startswith(b"HTTP/1.1 431")
    with socket.create_connection(address(server)) as sock:  # just under the limit: served
        sock.sendall(head + b"a" * (MAX_HEAD - 200) + b"\r\n\r\n")
        assert answer(sock).startswith(b"HTTP/1.1 200")


def test_the_listeners_settings_are_validated() -> None:
    with pytest.raises(BrokerConfigError, match="console_request_timeout = 0"):
        ConsoleConfig(request_timeout=0)
    with pytest.raises(BrokerConfigError, match="console_max_connections_per_address"):
        ConsoleConfig.from_mapping({"console_port": 0, "console_max_connections_per_address": 0})


def post(server: ConsoleServer, head: bytes, chunks: list[bytes], end: bytes) -> bytes:
    """Send ``head`` then the body's ``chunks`` until the console answers (or all of them and
    ``end``); its answer."""
    with socket.create_connection(address(server)) as sock:
        sock.settimeout(30)
        try:
            sock.sendall(head)
            for chunk in chunks:
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(chunk)
            else:
                sock.sendall(end)
        except OSError:  # closed by the console once it has answered
            pass
        return answer(sock)


def answer(sock: socket.socket) -> bytes:
    """What the console has sent on ``sock`` up to the end of a response's head, or until it closed."""
    sock.settimeout(30)
    received = b""
    try:
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            if not data:
                break
            received += data
    except ConnectionResetError:
        pass
    return received


def whole_response(sock: socket.socket) -> bytes:
    """A response of a known length read whole, so that only what follows it is left on ``sock``."""
    received = answer(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(length - len(body))
    return head + b"\r\n\r\n" + body
