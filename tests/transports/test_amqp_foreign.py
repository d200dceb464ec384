"""RabbitMQ messages published by another program (pika), not by `reliable`.

AMQP short strings are octets: a ``message_id`` or a header name that is not
UTF-8 comes back from pika as bytes. Such a message is processed, or
dead-lettered when its handler fails, and its neighbours go on. Real
RabbitMQ, and the store on SQLite and on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from backends.clock import SYSTEM_CLOCK
from backends.transport.amqp_transport import AmqpTransport
from reliable import Message
from reliable.testing import test_app

FOREIGN = {
    "id_not_utf8": pika.BasicProperties(message_id=b"\xff\xfe", headers={"a": "b"}),
    "header_name_not_utf8": pika.BasicProperties(message_id="m2", headers={b"\xff\xfe": "v", b"\xfe\xff": "w"}),
}


@pytest.fixture
def namespace(amqp_url: str, unique: str) -> Iterator[str]:
    yield unique
    with AmqpTransport(amqp_url, namespace=unique) as transport:
        transport.declare(unique, ["orders"])  # so that purge knows the group's queues
        transport.purge()


def _publish_foreign(amqp_url: str, namespace: str) -> None:
    """Publish `FOREIGN` to the topic's exchange as a program of its own would."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    for name, properties in FOREIGN.items():
        channel.basic_publish(f"{namespace}:t:orders", "", f'{{"id": "{name}"}}'.encode(), properties)
    connection.close()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
@pytest.mark.parametrize("fails", [False, True], ids=["processed", "dead_lettered"])
def test_foreign_short_strings_that_are_not_utf8_neither_stop_nor_merge(
    tmp_path: Path, amqp_url: str, postgres_url: str, namespace: str, store: str, fails: bool
) -> None:
    app = test_app(
        tmp_path,
        clock=SYSTEM_CLOCK,
        transport=f"{amqp_url}?namespace={namespace}",
        store=postgres_url if store == "postgresql" else None,
        settings={"RELIABLE_RETRY__MAX_REDELIVERIES": "0"},
    )
    seen: dict[str, Message] = {}

    @app.handler("orders", group=namespace)
    def handle(msg: Message, tx) -> None:
        seen[msg.body["id"]] = msg
        if fails and msg.body["id"] in FOREIGN:
            raise ValueError(f"cannot handle {msg.body['id']}")

    app.publish("orders", {"id": "before"})
    app.run(until_idle=True)  # the group's queue exists: the foreign messages reach it
    _publish_foreign(amqp_url, namespace)
    app.publish("orders", {"id": "after"})
    app.run(until_idle=True)

    assert set(seen) == {"before", "after", *FOREIGN}
    assert seen["id_not_utf8"].id == "\\xff\\xfe"
    assert dict(seen["header_name_not_utf8"].headers) == {"\\xff\\xfe": "v", "\\xfe\\xff": "w"}
    letters = {letter.message.body["id"]: letter for letter in app.dead_letters(namespace)}
    assert set(letters) == (set(FOREIGN) if fails else set())
    if fails:
        assert letters["id_not_utf8"].message.id == "\\xff\\xfe"
        assert letters["header_name_not_utf8"].message.headers["\\xfe\\xff"] == "w"
    app.close()
