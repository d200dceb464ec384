"""The done-offset watermark shared by the worker and the Kafka member: gaps, restarts, hand-backs."""

from __future__ import annotations

import pytest

from backends import watermark
from backends.types import Message, QueueRef
from backends.watermark import OffsetWatermark
from reliable.commit import OffsetWatermark as ReExported

REF = QueueRef("t", 0)


def message(offset: int, queue: int = 0) -> Message:
    return Message(id=f"m{offset}", topic="t", queue=queue, offset=offset, payload=b"{}")


def messages(*offsets: int) -> list[Message]:
    return [message(o) for o in offsets]


def test_the_framework_and_kafka_share_one_definition() -> None:
    import backends.transport.kafka_subscription as kafka

    assert ReExported is OffsetWatermark and kafka.OffsetWatermark is OffsetWatermark


def test_offsets_never_fetched_hold_the_position_back_unless_the_queue_is_read_in_order() -> None:
    shared = OffsetWatermark()  # a leasing transport: another member may hold offset 6
    in_order = OffsetWatermark(reads_in_order=True)  # Kafka: 6 is a transaction marker
    for mark in (shared, in_order):
        mark.fetched(messages(4, 5, 7))
        mark.mark_done(messages(4, 5, 7))
    assert shared.committable() == {REF: 6}
    assert in_order.committable() == {REF: 8}


def test_a_large_gap_after_a_message_still_in_flight_waits_for_it_only() -> None:
    mark = OffsetWatermark(reads_in_order=True)
    mark.fetched(messages(10))
    mark.fetched(messages(5_000_000))  # compacted away in between
    assert mark.mark_done(messages(5_000_000)) == {}
    assert mark.mark_done(messages(10)) == {REF: 5_000_001}


def test_a_queue_started_at_a_saved_offset_skips_what_retention_deleted_only_in_order() -> None:
    shared, in_order = OffsetWatermark(), OffsetWatermark(reads_in_order=True)
    for mark in (shared, in_order):
        mark.start({REF: 0})
        mark.fetched(messages(100))
    assert shared.mark_done(messages(100)) == {}
    assert in_order.mark_done(messages(100)) == {REF: 101}


def test_in_flight_messages_are_handed_back_and_positions_can_be_previewed() -> None:
    mark = OffsetWatermark(reads_in_order=True)
    mark.fetched(messages(0, 1, 2, 4))
    mark.mark_done(messages(1))
    assert [m.offset for m in mark.in_flight([REF])] == [0, 2, 4]
    assert mark.positions_if_done(messages(0)) == {REF: 2}
    assert mark.positions_if_done(messages(0, 2)) == {REF: 4}  # past skipped 3, up to 4 in flight
    assert mark.committable() == {REF: 0}  # previewing changed nothing


def test_a_message_fetched_again_below_the_position_holds_it_until_done_again() -> None:
    mark = OffsetWatermark()
    mark.fetched(messages(0, 1, 2))
    assert mark.mark_done(messages(0, 1, 2)) == {REF: 3}
    mark.fetched(messages(1))  # its lease ended and it came back
    assert mark.committable() == {REF: 1}
    assert mark.mark_done(messages(1)) == {}  # back where it was reported: nothing new to commit
    assert mark.committable() == {REF: 3}


def test_forgotten_queues_are_not_ours() -> None:
    mark = OffsetWatermark()
    mark.fetched(messages(0))
    mark.forget([REF])
    assert mark.mark_done(messages(0)) == {} and mark.committable() == {} and mark.in_flight([REF]) == []


def test_an_offset_below_the_position_of_a_queue_read_in_order_starts_it_again() -> None:
    """Kafka never gives an offset twice in one assignment: a lower one is a new log (the topic was
    deleted and created again). Its offsets above are new records, not the old ones that were done:
    counting them done moved the committed offset past records not processed yet."""
    mark = OffsetWatermark(reads_in_order=True)
    mark.fetched(messages(*range(20)))
    assert mark.mark_done(messages(*range(20))) == {REF: 20}
    mark.fetched(messages(*range(10)))  # offsets 0-9 of the new log
    assert mark.mark_done(messages(0)) == {REF: 1}
    assert mark.committable() == {REF: 1}
    assert [m.offset for m in mark.in_flight([REF])] == list(range(1, 10))


def test_done_runs_above_a_gap_are_joined_and_bounded_without_passing_the_gap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A member of a leasing transport shares each queue with the others: the offsets they take are
    gaps it never sees done, and it kept one run per stretch above them, for as long as it ran."""
    monkeypatch.setattr(watermark, "MAX_DONE_RUNS", 8)
    mark = OffsetWatermark()
    mark.fetched(messages(0))
    mark.mark_done(messages(0))
    ours = [offset for offset in range(2, 200) if offset % 4 in (2, 3)]  # 1, 4, 5, 8, 9, ...: another's
    for first, second in zip(ours[::2], ours[1::2]):  # 3 then 2: touching runs are one
        mark.fetched(messages(second, first))
        mark.mark_done(messages(second))
        mark.mark_done(messages(first))
    assert mark.committable() == {REF: 1}
    assert mark.positions_if_done(messages(1, 4, 5)) == {REF: 8}
    theirs = messages(*(offset for offset in range(1, 200) if offset not in ours))
    mark.fetched(theirs)  # the other member left: its messages come to this one
    mark.mark_done(theirs)
    assert mark.committable() == {REF: 34}  # through the 8 runs kept, 2-3 to 30-31; 34-35 was not kept


def test_a_run_at_the_position_is_taken_however_many_runs_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watermark, "MAX_DONE_RUNS", 2)
    mark = OffsetWatermark()
    mark.fetched(messages(0, 2, 4, 6))
    mark.mark_done(messages(2, 4, 6))  # the third run is past the bound: not kept
    assert mark.mark_done(messages(0)) == {REF: 1}
    assert mark.committable() == {REF: 1}  # 1 was never fetched: another member's
    mark.fetched(messages(1))
    assert mark.mark_done(messages(1)) == {REF: 3}  # up to the run of 2, kept; 4's was not


def test_what_the_group_finished_moves_a_position_held_by_another_members_offsets() -> None:
    """A member of a leasing transport never sees the others' offsets done: the group's finished
    prefix, as the transport tells it, moves its position over them, never back."""
    mark = OffsetWatermark()
    mark.fetched(messages(0, 1, 4, 5))  # 2-3 another member's
    assert mark.held() == {REF: {0, 1, 4, 5}}  # done, its own would still wait on 2-3
    mark.mark_done(messages(0, 1, 5))
    assert mark.held() == {REF: {4}} and mark.committable() == {REF: 2}
    assert mark.finished({REF: 6}) == {REF: 4}  # the group finished 2-3; its own 4 holds it
    assert mark.held() == {}
    assert mark.positions_if_done(messages(4)) == {REF: 6}
    assert mark.finished({REF: 3, QueueRef("t", 9): 7}) == {}  # never back; a queue not its own
    assert mark.committable() == {REF: 4}
    mark.mark_done(messages(4))
    assert mark.committable() == {REF: 6}
    assert mark.finished({REF: 10}) == {REF: 10}  # the others read on past it
    mark.fetched(messages(12))
    assert mark.held() == {REF: {12}} and mark.committable() == {REF: 10}


def test_what_the_group_finished_above_a_message_in_flight_is_done_once_it_is() -> None:
    """A member claimed again a message far below what it finished (a nacked one, or one whose
    lease ended): above it lie offsets another member finished, which it never sees done."""
    mark = OffsetWatermark()
    mark.fetched(messages(0, 1, 3, 5))  # 2 and 4 another member's, done
    mark.mark_done(messages(1, 3, 5))
    assert mark.held() == {REF: {0}} and mark.positions_if_done(messages(0)) == {REF: 2}
    assert mark.finished({REF: 7}) == {}  # 0 in flight holds the position
    assert mark.positions_if_done(messages(0)) == {REF: 7} and mark.held() == {}
    assert mark.mark_done(messages(0)) == {REF: 7}
