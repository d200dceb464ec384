"""Dead letters replayed or purged one by one: the others stay, listed and counted, across a restart."""

from __future__ import annotations

from broker.delivery import lookup
from broker.delivery.engine import Broker
from tests.broker.delivery.conftest import Open, drain, messages


def dead_letter_all(broker: Broker, count: int) -> None:
    broker.publish("orders", messages(count))
    billing = broker.join("billing", ["orders"])
    got = []
    while len(got) < count:
        got += broker.fetch(billing, count, 0)
    broker.dead_letter(billing, [d.receipt for d in got], "bad")
    broker.leave(billing)


def waiting(broker: Broker) -> tuple[list[bytes], int]:
    return [d.body for d in broker.dlq_list("billing")], lookup.dlq_waiting(broker, "billing")


def test_chosen_letters_go_back_to_their_group_only_and_the_rest_stay_across_a_restart(open_broker: Open) -> None:
    broker = open_broker()
    dead_letter_all(broker, 5)
    shipping = broker.join("shipping", ["orders"])
    assert len(drain(broker, shipping)) == 5
    letters = broker.dlq_list("billing")
    assert [d.offset for d in letters] == [0, 1, 2, 3, 4]
    m = [d.body for d in letters]  # in the order they were dead-lettered
    assert broker.dlq_replay_letters("billing", [1, 3, 3, 99]) == 2  # 99: no such letter
    assert waiting(broker) == ([m[0], m[2], m[4]], 3)
    billing = broker.join("billing", ["orders"])
    assert sorted(d.body for d in drain(broker, billing)) == sorted([m[1], m[3]])
    assert drain(broker, shipping) == []  # the replay went to billing only
    assert broker.dlq_replay_letters("billing", [1]) == 0  # settled already: not replayed twice
    broker.close()

    broker = open_broker()
    assert waiting(broker) == ([m[0], m[2], m[4]], 3)
    assert broker.dlq_purge_letters("billing", [0]) == 1  # the mark moves past 0 and 1
    assert waiting(broker) == ([m[2], m[4]], 2)
    assert broker.dlq_list("billing", 1)[0].body == m[2]
    assert broker.dlq_replay("billing") == 2  # the rest, not the settled ones again
    assert waiting(broker) == ([], 0)
    billing = broker.join("billing", ["orders"])
    assert sorted(d.body for d in drain(broker, billing)) == sorted([m[2], m[4]])
    broker.close()


def test_a_replayed_letter_keeps_its_message_id(open_broker: Open) -> None:
    """A replay used to send each letter under a new id, so a consumer that drops what it has seen
    by message id took a letter sent again (a replay cut between its send and its save) twice."""
    broker = open_broker()
    dead_letter_all(broker, 6)
    assert sorted(d.message_id for d in broker.dlq_list("billing")) == [f"m{n}" for n in range(6)]
    assert broker.dlq_replay_letters("billing", [0, 1]) == 2
    assert broker.dlq_replay("billing") == 4
    billing = broker.join("billing", ["orders"])
    assert sorted(d.message_id for d in drain(broker, billing)) == [f"m{n}" for n in range(6)]
