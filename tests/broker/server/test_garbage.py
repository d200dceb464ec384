"""Garbage on the native port, split into arbitrary chunks: errors at most, never a crash, never a changed store."""

from __future__ import annotations

import itertools
import socket
import struct
from collections.abc import Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.protocol import codec as native_codec
from broker.server.native_session import OPERATIONS
from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_fuzz_live import half_close

FIELDS = ["id", "op", "topic", "messages", "member", "group", "topics", "receipts", "offsets",
          "max_messages", "timeout", "delay", "queue", "offset", "key", "message_id", "limit"]
# no str values: a name (topic, group, member) is never valid, so nothing can be stored
ints = st.integers(-(2**63), 2**63 - 1)
junk = st.none() | st.booleans() | ints | st.floats() | st.binary(max_size=20) \
    | st.lists(ints | st.binary(max_size=5), max_size=3)
requests = st.fixed_dictionaries(
    {"id": st.integers(0, 2**32), "op": st.sampled_from(sorted(OPERATIONS) + ["hello", "nope"])},
    optional={name: junk for name in FIELDS[2:]})
streams = st.one_of(
    st.binary(max_size=200),  # raw bytes: framing errors
    st.lists(requests, min_size=1, max_size=5).map(
        lambda rs: b"".join(native_codec.encode(r) for r in rs)),  # framed, malformed requests
    st.lists(junk, max_size=3).map(msgpack.packb).map(
        lambda body: struct.pack(">IB", len(body) + 1, native_codec.VERSION) + body),  # not a map
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = ServerProcess(tmp_path_factory.mktemp("garbage") / "data").start()
    client = Client(started.url)
    client.publish("kept", [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(5)])
    client.close()
    yield started
    started.stop()


def snapshot(client: Client) -> tuple[object, ...]:
    return (sorted((t.name, t.messages) for t in client.topics()),
            sorted(g.name for g in client.groups()),
            [(d.message_id, d.body) for q in range(4) for d in client.read("kept", q, 0, 100)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=streams, cuts=st.lists(st.integers(0, 1000), max_size=6))
def test_garbage_in_any_chunks_leaves_the_server_serving_and_the_store_unchanged(server, stream, cuts) -> None:
    client = Client(server.url)
    before = snapshot(client)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        try:
            for a, b in itertools.pairwise(points):
                sock.sendall(stream[a:b])
            half_close(sock)  # the server may have ended the stream already
            while sock.recv(65536):  # every reply, until the server ends the connection
                pass
        except ConnectionError:
            pass  # the server closed a stream it could no longer trust
    assert snapshot(client) == before
    log = server.log.read_text()
    assert "request_failed" not in log and "session_failed" not in log  # no internal error, no crash
    client.close()
