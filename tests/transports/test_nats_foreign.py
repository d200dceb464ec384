"""JetStream messages published by another program, not by `reliable`.

Written with the server's own protocol (``HPUB`` on a plain socket), since the
point is header bytes that are not UTF-8, which nats-py cannot send and reads
as U+FFFD. Two messages whose ``Nats-Msg-Id`` differ only in such bytes are
two messages (JetStream keeps both): the consumer must process both. Real
NATS server, and the store on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from backends.clock import SYSTEM_CLOCK
from backends.transport.nats_transport import NatsTransport
from reliable import Message
from reliable.testing import test_app

FOREIGN = {"one": b"\xff\xfe", "two": b"\xfe\xff", "three": b"a\xff", "four": b"a\xfe"}
"""Body id -> its Nats-Msg-Id: pairs that nats-py reads as the same text."""


@pytest.fixture
def namespace(nats_url: str, unique: str) -> Iterator[str]:
    yield unique
    with NatsTransport(nats_url, namespace=unique) as transport:
        transport.purge()


def _publish_foreign(nats_url: str, subject: str) -> None:
    """HPUB each of `FOREIGN` with its raw ``Nats-Msg-Id``, as a program of its own would."""
    parts = urlsplit(nats_url)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222)) as sock:
        reader = sock.makefile("rb")
        reader.readline()  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"headers":true}\r\n')
        for name, message_id in FOREIGN.items():
            headers = b"NATS/1.0\r\nNats-Msg-Id: " + message_id + b"\r\n\r\n"
            body = f'{{"id": "{name}"}}'.encode()
            sock.sendall(b"HPUB %s %d %d\r\n%s%s\r\n" % (
                subject.encode(), len(headers), len(headers) + len(body), headers, body))
        sock.sendall(b"PING\r\n")
        assert reader.readline() == b"PONG\r\n"  # the server read every HPUB (an error would come first)


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
@pytest.mark.parametrize("fails", [False, True], ids=["processed", "dead_lettered"])
def test_msg_ids_that_are_not_utf8_are_not_taken_for_duplicates(
    tmp_path: Path, nats_url: str, postgres_url: str, namespace: str, store: str, fails: bool
) -> None:
    app = test_app(
        tmp_path,
        clock=SYSTEM_CLOCK,
        transport=f"{nats_url}?namespace={namespace}",
        store=postgres_url if store == "postgresql" else None,
        settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "0"},
    )
    seen: dict[str, str] = {}

    @app.handler("orders", group=namespace)
    def handle(msg: Message, tx) -> None:
        seen[msg.body["id"]] = msg.id
        if fails and msg.body["id"] in FOREIGN:
            raise ValueError(f"cannot handle {msg.body['id']}")

    app.publish("orders", {"id": "before"})  # the topic's stream exists: the foreign messages land in it
    _publish_foreign(nats_url, f"{namespace}.t.orders")
    app.publish("orders", {"id": "after"})
    app.run(until_idle=True)

    assert set(seen) == {"before", "after", *FOREIGN}
    assert len(set(seen.values())) == len(seen)  # every message its own id: none taken for another
    letters = {letter.message.body["id"] for letter in app.dead_letters(namespace)}
    assert letters == (set(FOREIGN) if fails else set())
    app.close()
