"""The store's primitives of a dead-letter replay: ids only, and chunks held while they are sent."""

from __future__ import annotations

import pytest

from backends.store import SqlStore, Store, open_store
from tests.contract.test_store import Boom, _letter


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

    def test_taken_letters_go_only_as_removed_and_only_when_it_commits(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(3)]
        with pytest.raises(Boom), store.take_dead_letters(unique, ids) as taken:
            assert [letter.id for letter in taken.letters] == ids
            taken.remove(ids)
            raise Boom("the transport went down")
        assert store.dead_letter_ids(unique) == ids
        with store.take_dead_letters(unique, ids[:2]) as taken:
            assert taken.remove([ids[0]]) == 1
        assert store.dead_letter_ids(unique) == ids[1:]

    def test_letters_one_replay_holds_are_skipped_by_another(self, postgres_url: str, unique: str) -> None:
        store = open_store(postgres_url)
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(3)]
        with store.take_dead_letters(unique, ids[:2]) as first:
            with store.take_dead_letters(unique, ids) as second:
                assert [letter.id for letter in second.letters] == ids[2:]
            assert [letter.id for letter in first.letters] == ids[:2]
        store.close()
