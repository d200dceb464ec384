"""The broker holds at most ``max_topics`` topics: past it a publish to a new name is refused.

Each queue a topic used keeps a file open and mapped in the broker's process: a user allowed
``orders.*`` publishing to a new name each time took a file descriptor and a memory map per
topic (measured: 3,000 topics, 3,008 descriptors and 3,279 maps), until the process hit its
descriptor limit or Linux's 65,530 maps and failed for everyone. Groups' own ``%RETRY%`` and
``%DLQ%`` topics do not count (``max_groups`` bounds them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import stomp

from broker.client import Client
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.errors import TooManyTopicsError
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.test_stomp import Inbox
from tests.waiting import wait_until

MAX_TOPICS = 3


def test_a_publish_to_a_new_topic_past_max_topics_is_refused(tmp_path: Path, unique) -> None:
    with threaded.serving(tmp_path, FakeClock(), {}, delivery=DeliveryConfig(max_topics=MAX_TOPICS)) as server:
        client = Client(threaded.native(server))
        made, refusal = [], ""
        for n in range(10):  # a new name each time
            try:
                client.publish(f"{unique}.{n}", [OutgoingMessage(b"x")])
                made.append(n)
            except TooManyTopicsError as error:
                refusal = str(error)
                break
        assert made == list(range(MAX_TOPICS))  # ten topics, and as many files, before
        assert f"max_topics={MAX_TOPICS}" in refusal
        client.publish(f"{unique}.0", [OutgoingMessage(b"y")])  # the topics there take messages
        member = client.join(f"{unique}-g", [f"{unique}.0"])  # a new group: its %RETRY% topic is not counted
        assert sorted(d.body for d in client.fetch(member, 10, 5.0)) == [b"x", b"y"]
        connection, inbox = stomp.Connection12([("127.0.0.1", server.port("stomp"))]), Inbox()
        connection.set_listener("inbox", inbox)
        connection.connect(wait=True)
        connection.send(f"/queue/{unique}.stomp", "z", receipt="sent")
        wait_until(lambda: inbox.errors, "the SEND to be refused")
        assert f"max_topics={MAX_TOPICS}" in inbox.errors[0].headers["message"]
        client.close()
        assert sorted(t.name for t in server.engine.api.topics() if t.name.startswith(unique)) == [
            f"{unique}.{n}" for n in range(MAX_TOPICS)]
    reopened = Broker(tmp_path / "broker", DeliveryConfig(max_topics=MAX_TOPICS))  # counted again at a start
    try:
        with pytest.raises(TooManyTopicsError):
            reopened.publish(f"{unique}.new", [OutgoingMessage(b"x")])
    finally:
        reopened.close()
