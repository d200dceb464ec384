"""Asking how much a group has left, or where it committed, makes no topic.

``pending`` of a group named ``%RETRY%<group>`` among the topics it counts and made it when the
broker did not hold it (and every topic asked about), ``group_offsets`` made its topic: a
misspelt group or topic asked about became a topic of the broker, counted against
``max_topics`` (and a group known to ``max_groups_per_user``, by its ``%RETRY%`` topic). A real
server.
"""

from __future__ import annotations

from contextlib import closing

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess


def test_pending_and_group_offsets_of_what_the_broker_does_not_hold_make_nothing(reliable_server: ServerProcess,
                                                                                  unique: str) -> None:
    with closing(Client(reliable_server.url)) as client:
        before = {t.name for t in client.topics()}
        assert client.pending(f"{unique}-g", [f"{unique}.typo"]) == 0
        assert client.group_offsets(f"{unique}-g", f"{unique}.typo") == []
        assert {t.name for t in client.topics()} == before  # neither the topic nor %RETRY%<group>
        client.publish(f"{unique}.orders", [OutgoingMessage(b"x"), OutgoingMessage(b"y")])
        assert client.pending(f"{unique}-g", [f"{unique}.orders"]) == 2  # a topic it holds counts
        assert len(client.group_offsets(f"{unique}-g", f"{unique}.orders")) == 4
        assert {t.name for t in client.topics()} - before == {f"{unique}.orders"}
