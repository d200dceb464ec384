"""The four attacks of issue 28, each played by a real client against a real server process.

Before groups were resources, each of these went through: a user with
rights on its own topics only joined another team's group, put messages
into it, moved its offsets past its unread messages, and listed every
topic and group of the broker. Each test shows the attack is refused and
the victim's messages are still there for the victim.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.protocol.errors import PermissionDeniedError
from tests.broker.server.serving import ServerProcess
from tests.passwords import hash_password


def _user(name: str, produce: list[str], consume: list[str], groups: list[str]) -> str:
    return (f'[broker.users.{name}]\npassword_hash = "{hash_password(name)}"\n'
            f"produce = {produce!r}\nconsume = {consume!r}\ngroups = {groups!r}\n").replace("'", '"')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("attacks")
    settings = folder / "reliable.toml"
    settings.write_text("[broker]\n"
                        + _user("billing", ["payments.*"], ["payments.*"], ["billing-*"])
                        + _user("orders", ["orders.*"], ["orders.*"], ["orders-*"]))
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def login(server: ServerProcess, name: str) -> Client:
    return Client(server.url, user=name, password=name)


def test_a_user_cannot_join_another_teams_group_to_take_its_retries(server, unique) -> None:
    billing, orders = login(server, "billing"), login(server, "orders")
    topic, group = f"payments.{unique}", f"billing-{unique}"
    billing.publish(topic, [OutgoingMessage(b"card 4242", message_id="p1")])
    member = billing.join(group, [topic])
    [delivery] = billing.fetch(member, 1, 5.0)
    billing.nack(member, [delivery.receipt], 0.0)  # to %RETRY%<group>, which only the group reads
    billing.leave(member)
    with pytest.raises(PermissionDeniedError, match=f"may not act as group '{group}'"):
        orders.join(group, [f"orders.{unique}"])  # its own topic, another team's group
    member = billing.join(group, [topic])
    assert [d.body for d in billing.fetch(member, 1, 5.0)] == [b"card 4242"]  # still the victim's


def test_a_producer_cannot_publish_into_another_groups_queue(server, unique) -> None:
    billing, orders = login(server, "billing"), login(server, "orders")
    group = f"billing-{unique}"
    member = billing.join(group, [f"payments.{unique}"])
    with pytest.raises(PermissionDeniedError, match=f"may not act as group '{group}'"):
        orders.publish_to_group(group, f"orders.{unique}", [OutgoingMessage(b"refund me")])
    assert billing.fetch(member, 10, 0.5) == []


def test_a_user_cannot_commit_another_groups_offsets_past_its_messages(server, unique) -> None:
    billing, orders = login(server, "billing"), login(server, "orders")
    topic, group = f"orders.{unique}", f"billing-{unique}"
    orders.publish(topic, [OutgoingMessage(b"order 1", message_id="o1")])
    with pytest.raises(PermissionDeniedError, match=f"may not act as group '{group}'"):
        orders.commit_group(group, topic, [10**9] * len(orders.queue_offsets(topic)))
    assert orders.queue_offsets(topic)[0][1] >= 1
    with pytest.raises(PermissionDeniedError):  # nor read them: billing may not consume orders.*
        billing.group_offsets(group, topic)


def test_listings_show_only_what_the_user_may_see(server, unique) -> None:
    billing, orders = login(server, "billing"), login(server, "orders")
    billing.publish(f"payments.{unique}", [OutgoingMessage(b"secret")])
    billing_member = billing.join(f"billing-{unique}", [f"payments.{unique}"])
    orders.publish(f"orders.{unique}", [OutgoingMessage(b"mine")])
    assert [t.name for t in orders.topics() if unique in t.name] == [f"orders.{unique}"]
    assert [g.name for g in orders.groups() if unique in g.name] == []
    with pytest.raises(PermissionDeniedError):
        orders.lag(f"billing-{unique}")
    assert "messages_published" not in orders.stats()  # the server's counters are the admin's
    seen = {t.name for t in orders.topics()}
    assert orders.stats()["topics"] == len([n for n in seen if not n.startswith("%")])
    assert [g.name for g in billing.groups() if unique in g.name] == [f"billing-{unique}"]
    billing.leave(billing_member)


@pytest.mark.parametrize("settle", ["ack", "nack", "dead_letter", "extend"])
def test_a_member_cannot_settle_another_groups_deliveries_by_their_receipts(server, unique, settle) -> None:
    """Receipts are ``<broker>.<fetch>:<n>``: one delivery of its own tells a member how the others'
    look. A receipt settles a delivery only for the member holding it; the victim's stays its own."""
    billing, orders = login(server, "billing"), login(server, "orders")
    payments, own = f"payments.{unique}", f"orders.{unique}"
    billing.publish(payments, [OutgoingMessage(b"card 4242", message_id="p1")])
    victim = billing.join(f"billing-{unique}", [payments], lease=60.0)
    [held] = billing.fetch(victim, 1, 5.0)
    orders.publish(own, [OutgoingMessage(b"order 1", message_id="o1")])
    attacker = orders.join(f"orders-{unique}", [own])
    [mine] = orders.fetch(attacker, 1, 5.0)
    assert held.receipt.split(".")[0] == mine.receipt.split(".")[0]  # the same broker prefix: guessable
    if settle == "nack":  # each went through before: the victim's delivery was gone or moved
        orders.nack(attacker, [held.receipt], 0.0)
    elif settle == "dead_letter":
        orders.dead_letter(attacker, [held.receipt], "forged")
    else:
        getattr(orders, settle)(attacker, [held.receipt])
    billing.nack(victim, [held.receipt], 0.0)  # the victim still holds it: its own nack works
    again = billing.fetch(victim, 1, 5.0)
    assert [(d.body, d.delivery_count) for d in again] == [(b"card 4242", 2)]
