"""``/topic/NAME`` subscriptions: what they leave in the broker is bounded by the topics, not by
how often clients subscribe.

Each subscription is a broadcasting member of its own (every subscriber gets every message,
a NACK comes back to the subscriber that sent it), and every group a member joins has a
``%RETRY%`` topic written to ``topics.json`` for good. A client subscribing and unsubscribing
in a loop must not grow the broker's groups and topics with it.
"""

from __future__ import annotations

import pytest
import stomp

from broker.client import Client
from broker.delivery.topics import MAX_NAME, check_name
from broker.errors import InvalidNameError
from broker.server.stomp_subscription import Destination
from tests.broker.server.test_stomp import Inbox
from tests.broker.server.test_stomp_headers import consumer, server  # noqa: F401 - the module's server

CYCLES = 5


def subscribe(connection: stomp.Connection, inbox: Inbox, destination: str, sub_id: str,
              ack: str = "auto") -> None:
    receipts = len(inbox.receipts)
    connection.subscribe(destination, id=sub_id, ack=ack, headers={"receipt": f"joined-{sub_id}"})
    assert inbox.wait_for(receipts + 1, "receipts")[-1] == f"joined-{sub_id}"


def listed(client: Client) -> tuple[set[str], set[str]]:
    return {t.name for t in client.topics()}, {g.name for g in client.groups()}


def test_subscribing_again_and_again_leaves_no_more_topics_or_groups_than_once(server, unique) -> None:  # noqa: F811
    admin = Client(server.url, user="app", password="s3cret")
    connection, inbox = consumer(server, "1.2")
    subscribe(connection, inbox, f"/topic/{unique}", "first")
    connection.unsubscribe("first")
    once = listed(admin)
    for cycle in range(CYCLES):
        again, again_inbox = consumer(server, "1.2")
        subscribe(again, again_inbox, f"/topic/{unique}", f"sub-{cycle}")
        subscribe(connection, inbox, f"/topic/{unique}", f"same-{cycle}")
        again.disconnect()
        connection.unsubscribe(f"same-{cycle}")
    assert listed(admin) == once
    connection.disconnect()
    admin.close()


def test_two_subscribers_each_get_every_message_and_a_nack_comes_back_to_its_sender(
        server, unique) -> None:  # noqa: F811
    first, one = consumer(server, "1.2")
    second, two = consumer(server, "1.2")
    subscribe(first, one, f"/topic/{unique}", "1", ack="client-individual")
    subscribe(second, two, f"/topic/{unique}", "1", ack="client-individual")
    first.send(f"/topic/{unique}", "news")
    [news_one], [news_two] = one.wait_for(1), two.wait_for(1)
    assert news_one.body == news_two.body == b"news"
    first.nack(news_one.headers["ack"])
    again = one.wait_for(2)[1]
    assert again.body == b"news" and again.headers["redelivered"] == "true"
    second.ack(news_two.headers["ack"])
    first.ack(again.headers["ack"])
    second.send(f"/topic/{unique}", "later", receipt="sent")  # behind the news on its queue: once
    assert two.wait_for(2)[1].body == b"later"  # it is here, a redelivered news would be too
    assert [m.body for m in two.messages] == [b"news", b"later"]
    first.disconnect()
    second.disconnect()


def test_every_topic_name_has_a_group_name_of_its_own() -> None:
    longest = ["t" * MAX_NAME, "t" * (MAX_NAME - 1) + "u", "x"]
    groups = [Destination.parse(f"/topic/{name}").group for name in longest]
    for group in groups:
        check_name("group", group)
    assert len(set(groups)) == len(groups)


def test_no_one_can_take_a_topics_stomp_group_before_its_subscribers(server, unique) -> None:  # noqa: F811
    """A group's kind is fixed by its first member: a clustering or ordered member of
    ``%STOMP%NAME`` (a user whose group rights match it, over the native protocol or as
    ``/queue/%STOMP%NAME``) used to make every later ``/topic/NAME`` subscription fail."""
    taken = Destination.parse(f"/topic/{unique}").group
    squatter = Client(server.url, user="app", password="s3cret")
    with pytest.raises(InvalidNameError, match="STOMP's /topic/ subscriptions"):
        squatter.join(taken, [unique])
    connection, inbox = consumer(server, "1.2")
    connection.subscribe(f"/queue/{taken}", id="squat", headers={"receipt": "squatted"})
    assert "STOMP's /topic/ subscriptions" in inbox.wait_for(1, "errors")[0].headers["message"]
    connection, inbox = consumer(server, "1.2")
    subscribe(connection, inbox, f"/topic/{unique}", "news")
    squatter.join(taken, [unique], broadcast=True)  # as STOMP joins: one more reader
    connection.send(f"/topic/{unique}", "hello")
    assert [m.body for m in inbox.wait_for(1)] == [b"hello"]
    connection.disconnect()
    squatter.close()
