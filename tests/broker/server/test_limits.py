"""TLS (minimum 1.2), the idle timeout and the slow-client timeout of the native listener, on a server process."""

from __future__ import annotations

import socket
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerUnavailableError
from broker.protocol import codec as native_codec
from broker.server.config import TlsConfig
from tests.broker.server.certificates import self_signed
from tests.broker.server.serving import ServerProcess
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(folder)
    settings = folder / "reliable.toml"
    settings.write_text(f'[broker]\ntls_certfile = "{cert}"\ntls_keyfile = "{key}"\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started, cert
    started.stop()


def test_a_tls_client_is_served_and_a_plain_one_is_not(tls_server, unique) -> None:
    server, cert = tls_server
    client = Client(server.url, tls=ssl.create_default_context(cafile=str(cert)))
    client.publish(unique, [OutgoingMessage(b"secret", message_id="s1")])
    member = client.join("g", [unique])
    assert [d.body for d in client.fetch(member, 10, 2.0)] == [b"secret"]
    client.close()
    plain = Client(server.url, publish_retry_seconds=0.5)
    with pytest.raises(BrokerUnavailableError):
        plain.topics()
    plain.close()


def test_fresh_tls_clients_publish_at_once_without_a_spurious_eof(tls_server, unique) -> None:
    """The client's reader thread sits in ``recv()`` while the caller's thread sends. On one
    ``ssl.SSLSocket`` (one OpenSSL object, used by two threads at once) the first publish of 25
    fresh clients in 300 failed with an EOF; `broker.tls_socket` keeps TLS under a lock."""
    server, cert = tls_server
    context = ssl.create_default_context(cafile=str(cert))
    failed = []
    for n in range(100):
        client = Client(server.url, tls=context, publish_retry_seconds=0)  # no retry hides a failure
        try:
            client.publish(unique, [OutgoingMessage(b"m", message_id=f"m{n}")])
        except BrokerUnavailableError as exc:
            failed.append(f"{n}: {exc}")
        client.close()
    assert failed == []


def test_tls_1_2_is_accepted_and_nothing_older(tls_server, tmp_path) -> None:
    server, cert = tls_server
    exactly_1_2 = ssl.create_default_context(cafile=str(cert))
    exactly_1_2.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        with exactly_1_2.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            assert tls.version() == "TLSv1.2"
    cert2, key2 = self_signed(tmp_path)
    assert TlsConfig(str(cert2), str(key2)).context().minimum_version == ssl.TLSVersion.TLSv1_2


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("strict")
    settings = folder / "reliable.toml"
    settings.write_text("[broker]\nidle_timeout = 0.5\nslow_client_timeout = 0.5\nmetrics_port = 0\n")
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def closes(sock: socket.socket) -> bool:
    """Whether the server ends the connection (reading whatever it still sends)."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    return True


def timeouts(server: ServerProcess, reason: str) -> float:
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()
    line = f'broker_connections_timed_out_total{{listener="native",reason="{reason}"}}'
    return sum(float(row.split()[-1]) for row in scraped.decode().splitlines() if row.startswith(line))


def test_a_silent_client_is_disconnected_after_the_idle_timeout(strict_server) -> None:
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=30) as sock:
        assert closes(sock)  # it sent nothing; the server hung up (the recv timeout is far longer)
    assert timeouts(strict_server, "idle") >= 1


def test_a_client_that_stops_reading_is_cut_off_and_others_are_served(strict_server, unique) -> None:
    client = Client(strict_server.url)
    client.publish(unique, [OutgoingMessage(b"x" * 60_000, message_id=f"big{n}") for n in range(50)])
    sock = socket.create_connection(("127.0.0.1", strict_server.port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = {"op": "read", "topic": unique, "queue": 0, "offset": 0, "max_messages": 50}
    try:  # ~3 MB of replies per request, never read
        for n in range(1, 40):
            sock.sendall(native_codec.encode({"id": n, **request}))
    except OSError:
        pass  # already cut off
    client.close()
    wait_until(lambda: timeouts(strict_server, "slow_client") >= 1, "the server to count a slow client")
    sock.close()
    other = Client(strict_server.url)  # the server serves others on
    assert unique in [t.name for t in other.topics()]
    other.close()
