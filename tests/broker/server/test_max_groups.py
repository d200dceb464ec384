"""``max_groups`` in ``[broker]``: a bound on the consumer groups a server holds.

A group is never deleted, and one whose members all left keeps its cursors
(about 10 KB of the server's memory each), so a client allowed group names
by a pattern could grow the server without bound. Past ``max_groups`` a join
of a new group name is refused with an error naming the setting; members of
the groups already there still join (RabbitMQ's per-vhost ``max-queues``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.errors import TooManyGroupsError
from tests.broker.server.serving import ServerProcess

MAX_GROUPS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("max-groups")
    settings = folder / "reliable.toml"
    settings.write_text(f"[broker]\nmax_groups = {MAX_GROUPS}\n")
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def test_a_new_group_past_max_groups_is_refused_and_existing_ones_still_join(server) -> None:
    client = Client(server.url)
    client.publish("orders", [OutgoingMessage(b"one", message_id="one")])
    for n in range(MAX_GROUPS):  # each joins once and leaves: the group stays
        client.leave(client.join(f"g{n}", ["orders"]))

    with pytest.raises(TooManyGroupsError, match=f"max_groups={MAX_GROUPS}"):
        client.join("one-too-many", ["orders"])

    member = client.join("g0", ["orders"])  # an existing group still joins, and still reads
    assert [d.body for d in client.fetch(member, 10, 5.0)] == [b"one"]
    assert "one-too-many" not in {info.name for info in client.groups()}
    client.close()
