"""Allocation strategies: every queue to exactly one member, the same answer every time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.delivery.allocation import (
    ByConfiguration,
    ByMachineRoom,
    ConsistentHash,
    averagely,
    averagely_by_circle,
)

QUEUES = [("orders", q) for q in range(8)]
STRATEGIES = [averagely, averagely_by_circle, ConsistentHash(),
              ByConfiguration({"b": [("orders", 7), ("orders", 6)]}),
              ByMachineRoom(lambda m: "east" if m < "c" else "west",
                            lambda q: "east" if q[1] % 2 else "west")]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: getattr(s, "__name__", type(s).__name__))
@given(queues=st.integers(0, 20), members=st.integers(1, 6))
def test_every_queue_goes_to_exactly_one_member(strategy, queues, members) -> None:
    names = [chr(ord("a") + n) for n in range(members)]
    keys = [("t", q) for q in range(queues)]
    first = strategy(keys, names)
    assert sorted(q for taken in first.values() for q in taken) == keys
    assert first == strategy(keys, names)


def test_averagely_gives_contiguous_blocks_and_circle_deals_them() -> None:
    assert averagely(QUEUES, ["a", "b", "c"]) == {
        "a": QUEUES[0:3], "b": QUEUES[3:6], "c": QUEUES[6:8]}
    assert averagely_by_circle(QUEUES, ["a", "b", "c"])["b"] == [QUEUES[1], QUEUES[4], QUEUES[7]]


def test_consistent_hash_moves_only_a_few_queues_when_a_member_joins() -> None:
    ring = ConsistentHash(virtual_nodes=50)
    queues = [("t", q) for q in range(200)]
    before = {q: m for m, taken in ring(queues, ["a", "b", "c"]).items() for q in taken}
    after = {q: m for m, taken in ring(queues, ["a", "b", "c", "d"]).items() for q in taken}
    moved = [q for q in queues if before[q] != after[q]]
    assert all(after[q] == "d" for q in moved) and len(moved) < 100


def test_configuration_and_machine_rooms_are_honoured() -> None:
    assert ByConfiguration({"b": [("orders", 7)]})(QUEUES, ["a", "b"])["b"][0] == ("orders", 7)
    rooms = ByMachineRoom(lambda m: {"a": "east", "b": "west"}[m], lambda q: "east" if q[1] < 4 else "west")
    result = rooms(QUEUES, ["a", "b"])
    assert result == {"a": QUEUES[:4], "b": QUEUES[4:]}
