"""After an outage, a batch is never settled through a membership that did not fetch it.

On `amqp://` a delivery tag belongs to the channel that delivered it: a new
membership refuses to ack a message it never held. Here a fetched batch
holds a poison message whose handler drops the connection (a TCP proxy in
front of the real RabbitMQ, which takes new connections at once): its dead
letter meets the outage and the worker leaves its group. The acks of the
rest of the batch must not go through a new membership (its refusal, a
`TransportError`, would end ``app.run()``): the batch comes back and is
skipped by its tokens, and the poison message is dead-lettered once.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import structlog

from backends.clock import SYSTEM_CLOCK
from backends.transport.amqp_transport import AmqpTransport
from reliable import Message
from reliable.testing import test_app
from tests.tcp_proxy import TcpProxy


class PoisonError(Exception):
    """Raised for the message no retry can help."""


def test_a_batch_whose_dead_letter_meets_an_outage_is_not_acked_by_a_new_member(
    tmp_path: Path, amqp_url: str, unique: str
) -> None:
    parts = urlsplit(amqp_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    proxied = amqp_url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
    app = test_app(tmp_path, clock=SYSTEM_CLOCK, transport=f"{proxied}?namespace={unique}",
                   settings={"RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": "2"})
    done: list[str] = []
    dropped: list[str] = []

    @app.handler(unique, token="body.id", fatal=[PoisonError])
    def handle(msg: Message, tx) -> None:
        if msg.body["id"] == "poison":
            if not dropped:
                dropped.append("once")
                proxy.cut()  # every connection dropped; new ones are taken again at once
                proxy.restore()
            raise PoisonError("no retry helps")
        done.append(msg.body["id"])

    try:
        bodies = [{"id": f"o{i}"} for i in range(300)]
        app.publish_many(unique, [*bodies[:150], {"id": "poison"}, *bodies[150:]])
        with structlog.testing.capture_logs() as logs:
            app.run(until_idle=True)
        events = [entry["event"] for entry in logs]
        assert dropped and "transport_unavailable" in events  # the dead letter met the outage
        assert sorted(set(done)) == sorted(b["id"] for b in bodies)  # nothing lost
        assert app.stats()["processed"] == 300  # nothing processed twice
        assert app.stats()["duplicate"] >= 1  # the unsettled batch came back and was skipped
        assert [letter.message.body["id"] for letter in app.dead_letters(handle.group)] == ["poison"]
    finally:
        app.close()
        proxy.close()
        with AmqpTransport(amqp_url, namespace=unique) as transport:
            transport.declare(handle.group, [unique])  # so that purge knows the group's queues
            transport.purge()
