"""A message above what Redis reads as one argument (``proto-max-bulk-len``, 512 MiB by default):
Redis closed the connection, which the transport took for an outage, so `App.publish` waited out
``publish_timeout`` and the outbox relay retried its whole pass for ever, every row behind it held.

A redis-server of the test's own, its ``proto-max-bulk-len`` at its smallest (1 MiB).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.errors import TransportError
from backends.store.outbox import RowState
from backends.transport import open_transport
from backends.types import OutgoingMessage
from reliable import App
from reliable.settings import Settings
from tests.transports.test_redis_server_events import RedisServer

LIMIT = 1024 * 1024


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, "--proto-max-bulk-len", str(LIMIT))
    server.start()
    yield server
    server.stop()


def test_a_body_above_proto_max_bulk_len_is_refused_naming_it(server: RedisServer) -> None:
    transport = open_transport(server.url)
    member = transport.subscribe("g", ["orders"])
    # far above: Redis closes the connection while the client still writes (an outage, on the old
    # code); just above: it answers "invalid bulk length"
    for fields in ({"payload": b"x" * 64 * LIMIT}, {"payload": b"x" * (LIMIT + 1)},
                   {"payload": b"x", "headers": {"h": "v" * LIMIT}}):
        with pytest.raises(TransportError, match=rf"above the server's proto-max-bulk-len={LIMIT}"):
            transport.publish("orders", [OutgoingMessage(b"first", message_id="first"),
                                         OutgoingMessage(**fields, message_id="big")])  # type: ignore[arg-type]
    transport.publish("orders", [OutgoingMessage(b"x" * (LIMIT - 100), message_id="fits")])
    assert [m.id for m in member.fetch(10, 5)] == ["fits"]  # nothing of the refused calls was sent
    member.close()
    transport.close()


def test_the_relay_marks_a_row_above_it_failed_and_sends_the_rest(server: RedisServer, tmp_path: Path) -> None:
    """The row is marked failed with the reason; rows of other keys and without a key are sent;
    the rows of its key after it wait behind it (per-key order) until ``reliable outbox retry``."""
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": server.url}))
    with app.store.transaction() as tx:
        tx.publish("orders", {"n": 1}, key="a")
        tx.publish("orders", "x" * 64 * LIMIT, key="big")  # Redis closes the connection on it
        tx.publish("orders", {"n": 2}, key="big")
        tx.publish("orders", {"n": 3}, key="c")
        tx.publish("orders", {"n": 4})
    member = app.transport.subscribe("g", ["orders"])
    app.relay().drain()
    outbox = app.store.outbox
    (failed,) = outbox.rows(RowState.FAILED)
    assert failed.key == "big"
    assert f"proto-max-bulk-len={LIMIT}" in (failed.error or "")
    assert [row.key for row in outbox.rows(RowState.PENDING)] == ["big"]
    assert sorted(m.body["n"] for m in member.fetch(10, 5)) == [1, 3, 4]
    status = outbox.status()
    assert (status.failed, status.sent) == (1, 3)
    member.close()
    app.close()
