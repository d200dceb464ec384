"""The store's primitives of a dead-letter replay: ids only, and chunks held (by a mark, not a
transaction) while they are sent."""

from __future__ import annotations

import tracemalloc

from backends.clock import FakeClock
from backends.store import SqlStore, Store, open_store
from tests.contract.test_store import _letter


class TestDeadLetterReplayPrimitives:
    def test_ids_of_a_group_chosen_ids_and_replayed_ones(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(4)]
            tx.add_dead_letter(_letter(unique + "-other", 9, b"{}"))
        assert isinstance(store, SqlStore) and store.mark_replayed([ids[1], ids[3]]) == 2
        assert store.dead_letter_ids(unique) == ids
        assert store.dead_letter_ids(unique, [ids[2], ids[0], 999_999_999]) == [ids[0], ids[2]]
        assert store.dead_letter_ids(unique, min_replays=1) == [ids[1], ids[3]]
        assert store.dead_letter_ids(unique + "-other", ids) == []

    def test_taken_letters_are_held_until_settled_and_only_the_sent_ones_go(self, store: Store, unique: str) -> None:
        """A replay used to hold its chunk in an open write transaction while it sent it (on
        SQLite: the whole database's lock); a take is now a short write of its own."""
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(4)]
        taken = store.take_dead_letters(unique, ids[:3], 60.0)
        assert [letter.id for letter in taken] == ids[:3]
        assert [letter.id for letter in store.take_dead_letters(unique, ids, 60.0)] == ids[3:]  # another replay
        with store.transaction() as tx:  # the store takes other writes meanwhile
            tx.add_dead_letter(_letter(unique, 9, b"{}"))
        assert store.delete_dead_letters(ids[:3]) == 0  # a purge leaves them to the replay sending them
        assert store.settle_dead_letters([ids[0]], [ids[1]]) == 1  # sent; refused (or not reached)
        assert store.dead_letter_ids(unique, ids) == ids[1:]
        assert [letter.id for letter in store.take_dead_letters(unique, ids[:3], 60.0)] == [ids[1]]  # let go
        assert store.delete_dead_letters([ids[2]]) == 0  # still held

    def test_a_hold_that_ran_out_lets_another_replay_take_the_letters(
        self, store: Store, unique: str, fake_clock: FakeClock
    ) -> None:
        """What a replay killed mid-send held goes to the next replay once the hold ran out."""
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(2)]
        assert len(store.take_dead_letters(unique, ids, 60.0)) == 2
        fake_clock.advance(59.0)
        assert store.take_dead_letters(unique, ids, 60.0) == []
        fake_clock.advance(1.0)
        assert [letter.id for letter in store.take_dead_letters(unique, ids, 60.0)] == ids
        fake_clock.advance(60.0)
        assert store.delete_dead_letters(ids) == 2

    def test_letters_one_replay_holds_are_skipped_by_another(self, postgres_url: str, unique: str) -> None:
        """Two replays taking at once on PostgreSQL: row locks, then the hold, decide who sends."""
        store, other = open_store(postgres_url), open_store(postgres_url)
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(3)]
        assert [letter.id for letter in store.take_dead_letters(unique, ids[:2], 60.0)] == ids[:2]
        assert [letter.id for letter in other.take_dead_letters(unique, ids, 60.0)] == ids[2:]
        store.close()
        other.close()


def test_a_listing_reads_only_the_head_of_each_body(store: Store, unique: str) -> None:
    """A page of 100 MiB bodies was read whole into memory to show a line of each (the console's
    listing, `reliable dlq list`); the database now cuts them, and says how large they are."""
    body = bytes(range(256)) * (8 * 1024)  # 2 MiB, not text
    with store.transaction() as tx:
        ids = [tx.add_dead_letter(_letter(unique, offset, body)) for offset in range(4)]
    tracemalloc.start()
    try:
        listed = store.dead_letters(unique, body_limit=480)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [letter.id for letter in listed] == ids
    assert {(letter.message.payload, letter.body_size) for letter in listed} == {(body[:480], len(body))}
    assert peak < len(body)  # four whole bodies were 8 MiB
    assert {letter.message.payload for letter in store.dead_letters(unique, body_limit=0)} == {b""}
    whole = store.dead_letters(unique, limit=1)[0]  # what a replay reads: the body as published
    assert (whole.message.payload, whole.body_size) == (body, None)
