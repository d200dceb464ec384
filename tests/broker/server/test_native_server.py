"""The native listener's security and limits, against a real server process.

Credentials, permissions, the frame size checked from the length prefix
before any body byte is read, the connection limit, malformed and unknown
requests: each gets an error frame (and a closed connection where the
stream can no longer be trusted), the server keeps serving, nothing stored
changes.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Iterator

import msgpack
import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.protocol import codec as native_codec
from broker.protocol.errors import AuthenticationError, PermissionDeniedError
from tests.broker.server.serving import ServerProcess
from tests.passwords import hash_password


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("native")
    settings = folder / "reliable.toml"
    settings.write_text(
        "[broker]\nmax_frame_size = 65536\nmax_connections = 4\n"
        f'[broker.users.app]\npassword_hash = "{hash_password("s3cret")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n'
        f'[broker.users.reader]\npassword_hash = "{hash_password("r3ad")}"\n'
        'produce = []\nconsume = ["*"]\ngroups = ["*"]\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def raw(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def reply(sock: socket.socket) -> dict:  # type: ignore[type-arg]
    decoder = native_codec.FrameDecoder(1 << 20)
    while True:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        frames = decoder.feed(data)
        if frames:
            return native_codec.decode_body(frames[0])


def closed(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (reading what it still sends)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        return True


def test_credentials_and_permissions(server, unique) -> None:
    app = Client(server.url, user="app", password="s3cret")
    app.publish(unique, [OutgoingMessage(b"x", message_id="x")])
    with pytest.raises(AuthenticationError):
        Client(server.url, user="app", password="wrong").topics()
    anonymous = raw(server)  # no hello: nothing is served, nothing is read
    anonymous.sendall(native_codec.encode({"id": 1, "op": "subscribe", "group": "g", "topics": [unique]}))
    assert reply(anonymous)["error"]["code"] == "unauthenticated"
    reader = Client(server.url, user="reader", password="r3ad")
    with pytest.raises(PermissionDeniedError):
        reader.publish(unique, [OutgoingMessage(b"y")])
    member = reader.join("g", [unique])
    assert [d.body for d in reader.fetch(member, 10, 2.0)] == [b"x"]  # only what app sent
    for client in (app, reader):
        client.close()
    anonymous.close()


def test_an_oversized_frame_is_refused_from_its_length_prefix(server) -> None:
    sock = raw(server)
    sock.sendall(struct.pack(">IB", 10_000_000, native_codec.VERSION))  # announces 10 MB, sends no body
    error = reply(sock)
    assert error["error"]["code"] == "frame_too_large" and error["fatal"]
    assert closed(sock)


def test_malformed_and_unknown_requests_get_errors_and_the_server_goes_on(server, unique) -> None:
    sock = raw(server)
    hello = {"id": 1, "op": "hello", "user": "app", "password": "s3cret"}
    sock.sendall(native_codec.encode(hello))
    assert reply(sock)["ok"]
    sock.sendall(native_codec.encode({"id": 2, "op": "launch_rockets"}))
    assert reply(sock)["error"]["code"] == "unknown_operation"
    sock.sendall(native_codec.encode({"id": 3, "op": "publish", "topic": unique, "messages": "nope"}))
    assert reply(sock)["error"]["code"] == "malformed_frame"
    payload = msgpack.packb([1, 2, 3])
    sock.sendall(struct.pack(">IB", len(payload) + 1, native_codec.VERSION) + payload)  # a body that is not a map
    assert reply(sock)["error"]["code"] == "malformed_frame"
    sock.sendall(native_codec.encode({"id": 4, "op": "topics"}))
    assert reply(sock)["ok"]  # the same connection still works
    sock.close()
    assert Client(server.url, user="app", password="s3cret").pending("g", [unique]) >= 0


def test_connection_n_plus_one_is_refused(server) -> None:
    held = [raw(server) for _ in range(4)]
    for sock in held:  # make sure each is accepted before the next one
        sock.sendall(native_codec.encode({"id": 1, "op": "ping"}))
        reply(sock)
    extra = raw(server)
    refused = reply(extra)
    assert refused["error"]["code"] == "too_many_connections"
    for sock in (*held, extra):
        sock.close()


def test_prometheus_metrics_of_the_broker(tmp_path, unique) -> None:
    import urllib.request

    settings = tmp_path / "reliable.toml"
    settings.write_text("[broker]\nmetrics_port = 0\n")
    server = ServerProcess(tmp_path / "data", "--settings", str(settings)).start()
    client = Client(server.url)
    client.publish(unique, [OutgoingMessage(b"12345", message_id=f"m{n}") for n in range(3)])
    member = client.join("audit", [unique])
    first = client.fetch(member, 3, 2.0)
    client.nack(member, [first[0].receipt], 0.0)
    client.ack(member, [d.receipt for d in first[1:]])
    again = client.fetch(member, 3, 2.0)
    client.dead_letter(member, [again[0].receipt], "poison")
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    assert f'broker_messages_published_total{{topic="{unique}"}} 3.0' in text
    assert f'broker_bytes_published_total{{topic="{unique}"}} 15.0' in text
    assert 'broker_messages_redelivered_total{topic="%RETRY%audit"} 1.0' in text
    assert 'broker_messages_dead_lettered_total{group="audit"} 1.0' in text
    assert 'broker_group_lag{group="audit"' in text and "broker_connections_total" in text
    assert "broker_publish_seconds_count 1.0" in text  # one publish request, timed
    fsyncs = re.search(r"^broker_fsync_seconds_count (\S+)$", text, re.MULTILINE)
    assert fsyncs is not None and float(fsyncs.group(1)) >= 1  # flush = "sync": the publish waited for one
    client.close()
    server.stop()
