"""The `Store` contract, run against every backend: SQLite and the real PostgreSQL."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select, text
from sqlalchemy.exc import DataError

from backends.clock import FakeClock
from backends.errors import (
    ConfigurationError,
    FenceConflictError,
    StoreUnavailableError,
    UnsupportedURLError,
)
from backends.store import SqlStore, Store, TokenState, open_store
from backends.store.postgresql import COPY_CLAIM_MIN
from backends.types import DeadLetter, Failure, Message, QueueRef

TTL = 3600.0


class Boom(Exception):
    """The user's own failure inside a handler."""


@pytest.fixture
def writes(store: Store, unique: str) -> Iterator[Table]:
    """A table of the user's own, written by the "handler" in the tests."""
    table = Table(
        f"handler_{unique}",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("token", String(64)),
    )
    assert isinstance(store, SqlStore)
    table.create(store.engine)
    yield table
    table.drop(store.engine)


def rows(store: Store, table: Table) -> list[str]:
    assert isinstance(store, SqlStore)
    with store.engine.connect() as connection:
        return sorted(connection.execute(select(table.c.token)).scalars())


class TestClaim:
    def test_new_tokens_are_claimed_once(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            assert tx.claim(unique, ["a", "b", "a"], TTL) == {"a", "b"}
        with store.transaction() as tx:
            assert tx.claim(unique, ["a", "c"], TTL) == {"c"}
        assert store.known(unique, ["a", "b", "c", "d"]) == {"a", "b", "c"}

    def test_namespaces_are_independent(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            tx.claim(unique, ["a"], TTL)
            assert tx.claim(unique + "-other", ["a"], TTL) == {"a"}

    def test_expired_token_is_reclaimed(
        self, store: Store, unique: str, fake_clock: FakeClock
    ) -> None:
        with store.transaction() as tx:
            tx.claim(unique, ["a"], 10)
        fake_clock.advance(11)
        assert store.known(unique, ["a"]) == set()
        with store.transaction() as tx:
            assert tx.claim(unique, ["a"], 10) == {"a"}
        assert store.known(unique, ["a"]) == {"a"}

    def test_large_batches_cross_parameter_limits(self, store: Store, unique: str) -> None:
        batch = [f"token-{i}" for i in range(2500)]
        with store.transaction() as tx:
            assert tx.claim(unique, batch, TTL) == set(batch)
        assert store.known(unique, batch + ["missing"]) == set(batch)
        with store.transaction() as tx:
            assert tx.claim(unique, batch, TTL) == set()
        assert store.forget(unique, batch) == 2500

    def test_claims_of_copy_size_batches_agree_with_the_unique_index(
        self, store: Store, unique: str, fake_clock: FakeClock
    ) -> None:
        """On PostgreSQL a batch of COPY_CLAIM_MIN tokens or more is first COPYed in; a single
        known, expired or leased token makes it fall back. Every outcome must match the claim."""
        size = COPY_CLAIM_MIN
        first = [f"a-{i:05d}" for i in range(size)]
        with store.transaction() as tx:
            assert tx.claim(unique, first + first[:10], TTL) == set(first)  # all new
        second = [f"b-{i:05d}" for i in range(size)]
        with store.transaction() as tx:  # one known token in the middle
            assert tx.claim(unique, [*second, first[size // 2]], TTL) == set(second)
        third = [f"c-{i:05d}" for i in range(size)]
        with store.transaction() as tx:
            assert tx.claim(unique, third, TTL) == set(third)  # all new again
        with store.transaction() as tx:
            tx.claim(unique, ["short-lived"], 10)
        assert store.lease(unique, "leased", 1000).acquired
        fake_clock.advance(11)
        fourth = [f"d-{i:05d}" for i in range(size)]
        with store.transaction() as tx:  # an expired token is reclaimed, a live lease is not
            assert tx.claim(unique, [*fourth, "short-lived", "leased"], TTL) == {
                *fourth, "short-lived"}
        with pytest.raises(Boom), store.transaction() as tx:
            tx.claim(unique, [f"e-{i:05d}" for i in range(size)], TTL)
            raise Boom  # rolled back: nothing of it stays
        assert store.known(unique, ["e-00000", "e-04999"]) == set()
        everything = first + second + third + fourth + ["short-lived"]
        assert store.known(unique, everything) == set(everything)

    def test_tokens_that_need_escaping_in_copy_text_are_stored_as_given(
        self, store: Store, unique: str
    ) -> None:
        """COPY's text format gives tab, newline, return and backslash meanings; none may
        split, merge or change a token (nor the namespace) in a COPY-size batch."""
        odd = ["tab\there", "new\nline", "cr\rhere", "back\\slash", "\\.", "\\N", "é ✓", ""]
        batch = odd + [f"plain-{i:05d}" for i in range(COPY_CLAIM_MIN)]
        namespace = f"{unique}\t\\ns"
        with store.transaction() as tx:
            assert tx.claim(namespace, batch, TTL) == set(batch)
        assert store.known(namespace, odd) == set(odd)
        assert store.known(unique, odd) == set()  # the namespace kept its tab and backslash
        with store.transaction() as tx:
            assert tx.claim(namespace, batch, TTL) == set()

    @pytest.mark.parametrize("odd", ["new\nline", ""], ids=["line-break", "empty"])
    def test_a_batch_claims_odd_tokens_as_given(self, store: Store, unique: str, odd: str) -> None:
        """A batch travels as one text of lines on PostgreSQL: a token with a line break, or an
        empty one, must neither split nor vanish, whether it is claimed or already known."""
        batch = [odd, "a", "b"]
        with store.transaction() as tx:
            assert tx.claim(unique, batch, TTL) == set(batch)
        with store.transaction() as tx:
            assert tx.claim(unique, [*batch, "c"], TTL) == {"c"}
        with store.transaction() as tx:
            assert tx.claim(unique, ["d", odd, "e"], TTL) == {"d", "e"}
        assert store.known(unique, [odd, "new", "line", "z"]) == {odd}

    def test_concurrent_copy_size_claims_take_each_token_once(
        self, store: Store, unique: str
    ) -> None:
        tokens = [f"t-{i:05d}" for i in range(2 * COPY_CLAIM_MIN)]
        claimed: list[set[str]] = []

        def work(start: int) -> None:  # overlapping halves: the middle third is contended
            part = tokens[start : start + COPY_CLAIM_MIN + COPY_CLAIM_MIN // 2]
            with store.transaction() as tx:
                claimed.append(tx.claim(unique, part, TTL))

        _run_threads([functools.partial(work, 0), functools.partial(work, COPY_CLAIM_MIN // 2)])
        assert sum(len(part) for part in claimed) == len(set().union(*claimed))
        assert set().union(*claimed) == set(tokens[: 2 * COPY_CLAIM_MIN])

    def test_forget_allows_a_new_claim(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            tx.claim(unique, ["a", "b"], TTL)
        assert store.forget(unique, ["a", "zzz"]) == 1
        with store.transaction() as tx:
            assert tx.claim(unique, ["a", "b"], TTL) == {"a"}

    def test_purge_expired_keeps_live_tokens(
        self, store: Store, unique: str, fake_clock: FakeClock
    ) -> None:
        with store.transaction() as tx:
            tx.claim(unique, ["short"], 10)
            tx.claim(unique, ["long"], TTL)
        fake_clock.advance(11)
        assert store.purge_expired() >= 1
        assert store.known(unique, ["short", "long"]) == {"long"}
        assert store.forget(unique, ["short"]) == 0


class TestTransaction:
    def test_rollback_leaves_no_token_and_no_handler_write(
        self, store: Store, unique: str, writes: Table
    ) -> None:
        error = Boom("handler failed")
        with pytest.raises(Boom) as raised, store.transaction() as tx:
            tx.claim(unique, ["a"], TTL)
            tx.execute(writes.insert().values(token="a"))
            raise error
        assert raised.value is error
        assert store.known(unique, ["a"]) == set()
        assert rows(store, writes) == []
        with store.transaction() as tx:
            assert tx.claim(unique, ["a"], TTL) == {"a"}

    def test_commit_keeps_token_and_handler_write(
        self, store: Store, unique: str, writes: Table
    ) -> None:
        with store.transaction() as tx:
            tx.claim(unique, ["a"], TTL)
            tx.execute(text(f"INSERT INTO {writes.name} (token) VALUES (:token)"), {"token": "a"})
        assert store.known(unique, ["a"]) == {"a"}
        assert rows(store, writes) == ["a"]

    def test_users_database_error_is_not_wrapped(self, store: Store) -> None:
        with pytest.raises(Exception) as raised, store.transaction() as tx:
            tx.execute(text("SELECT * FROM no_such_table_anywhere"))
        assert not isinstance(raised.value, StoreUnavailableError)

    def test_savepoint_rolls_back_only_its_own_writes(
        self, store: Store, unique: str, writes: Table
    ) -> None:
        with store.transaction() as tx:
            with tx.savepoint():
                tx.claim(unique, ["good"], TTL)
                tx.execute(writes.insert().values(token="good"))
            with pytest.raises(Boom), tx.savepoint():
                tx.claim(unique, ["poison"], TTL)
                tx.execute(writes.insert().values(token="poison"))
                raise Boom("poison message")
            with tx.savepoint():
                tx.claim(unique, ["after"], TTL)
        assert store.known(unique, ["good", "poison", "after"]) == {"good", "after"}
        assert rows(store, writes) == ["good"]

    def test_concurrent_twin_waits_then_is_a_duplicate(self, store: Store, unique: str) -> None:
        assert _twin_claims(store, unique, first_commits=True) == set()

    def test_concurrent_twin_claims_after_a_rollback(self, store: Store, unique: str) -> None:
        assert _twin_claims(store, unique, first_commits=False) == {"twin"}

    def test_readers_do_not_wait_for_an_open_writer(self, store: Store, unique: str) -> None:
        writing, read_done = threading.Event(), threading.Event()

        def writer() -> None:
            with store.transaction() as tx:
                tx.claim(unique, ["a"], TTL)
                writing.set()
                read_done.wait(10)  # a reader blocked on us would make this time out

        def reader() -> None:
            writing.wait(5)
            seen_while_open.append(store.known(unique, ["a"]))
            read_done.set()

        seen_while_open: list[set[str]] = []
        _run_threads([writer, reader])
        assert seen_while_open == [set()]  # uncommitted, and answered while still open
        assert store.known(unique, ["a"]) == {"a"}

    def test_threads_claim_each_token_exactly_once(self, store: Store, unique: str) -> None:
        batch = [f"t{i}" for i in range(40)]
        claimed: list[set[str]] = []

        def work(offset: int) -> None:
            rotated = batch[offset:] + batch[:offset]
            with store.transaction() as tx:
                claimed.append(tx.claim(unique, rotated, TTL))

        _run_threads([functools.partial(work, i * 5) for i in range(8)])
        assert sum(len(part) for part in claimed) == len(batch)
        assert set().union(*claimed) == set(batch)


def _twin_claims(store: Store, unique: str, first_commits: bool) -> set[str]:
    """The first thread claims "twin" and holds its transaction; return what the twin claims."""
    first_claimed, order = threading.Event(), []
    twin_result: list[set[str]] = []

    def first() -> None:
        try:
            with store.transaction() as tx:
                tx.claim(unique, ["twin"], TTL)
                first_claimed.set()
                threading.Event().wait(0.3)  # hold the transaction open while the twin starts
                order.append("first ends")
                if not first_commits:
                    raise Boom("first fails")
        except Boom:
            pass

    def twin() -> None:
        first_claimed.wait(5)
        with store.transaction() as tx:
            twin_result.append(tx.claim(unique, ["twin"], TTL))
            order.append("twin claimed")

    _run_threads([first, twin])
    assert order == ["first ends", "twin claimed"]
    return twin_result[0]


def _run_threads(targets: list[Callable[[], None]]) -> None:
    """Run ``targets`` concurrently; re-raise the first failure in the test's thread."""
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        for future in [pool.submit(target) for target in targets]:
            future.result(timeout=30)


class TestLease:
    def test_lease_lifecycle(self, store: Store, unique: str, fake_clock: FakeClock) -> None:
        assert store.lease(unique, "call", 30).acquired
        held = store.lease(unique, "call", 30)
        assert (held.acquired, held.state) == (False, TokenState.IN_PROGRESS)
        assert held.expires_at == pytest.approx(fake_clock.time() + 30)
        fake_clock.advance(31)  # the holder crashed: its lease lapses
        assert store.lease(unique, "call", 30).acquired
        store.complete_lease(unique, "call", {"status": 201, "body": "ok"}, TTL)
        done = store.lease(unique, "call", 30)
        assert (done.acquired, done.state) == (False, TokenState.DONE)
        assert done.result == {"status": 201, "body": "ok"}
        assert store.known(unique, ["call"]) == {"call"}
        store.release_lease(unique, "call")  # a DONE record is never released
        assert not store.lease(unique, "call", 30).acquired
        fake_clock.advance(TTL + 1)
        assert store.lease(unique, "call", 30).acquired

    def test_concurrent_leases_have_one_winner(self, store: Store, unique: str) -> None:
        outcomes: list[bool] = []

        def take() -> None:
            outcomes.append(store.lease(unique, "call", 30).acquired)

        _run_threads([take] * 6)
        assert sorted(outcomes) == [False] * 5 + [True]

    def test_released_lease_can_be_taken_again(self, store: Store, unique: str) -> None:
        assert store.lease(unique, "call", 30).acquired
        store.release_lease(unique, "call")
        assert store.lease(unique, "call", 30).acquired
        assert store.known(unique, ["call"]) == set()


class TestFence:
    def test_new_replay_and_conflict(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            assert tx.fence(unique, 0, "run-a")
            assert tx.fence(unique, 1, "run-a")
        with store.transaction() as tx:
            assert not tx.fence(unique, 1, "run-a")
            assert not tx.fence(unique, 0, "run-a")
            assert tx.fence(unique, 2, "run-a")
        with pytest.raises(FenceConflictError) as raised, store.transaction() as tx:
            tx.fence(unique, 2, "run-b")
        for part in (unique, "2", "run-a", "run-b"):
            assert part in str(raised.value)
        with store.transaction() as tx:
            assert tx.fence(unique, 3, "run-b")  # beyond what run-a recorded: a continuation

    def test_fence_rolls_back_with_the_batch(self, store: Store, unique: str) -> None:
        with pytest.raises(Boom), store.transaction() as tx:
            assert tx.fence(unique, 7, "run")
            raise Boom("batch failed")
        with store.transaction() as tx:
            assert tx.fence(unique, 7, "run")


def _letter(group: str, offset: int, payload: bytes) -> DeadLetter:
    failure = Failure("ValueError", "bad amount", "Traceback ...\nValueError", 3, 100.0, 160.0)
    message = Message(
        id=f"m-{offset}",
        topic="payments",
        queue=2,
        offset=offset,
        payload=payload,
        key="k-1",
        headers={"content-type": "application/json", "x": "é"},
        attempt=3,
        published_at=99.5,
        first_failure_at=100.0,
    )
    return DeadLetter(group=group, message=message, token=f"tok-{offset}", failure=failure)


class TestDeadLetters:
    def test_round_trip_keeps_payload_bytes(self, store: Store, unique: str) -> None:
        letter = _letter(unique, 41, b"\xff\xfe\x00not utf-8\x80")
        with store.transaction() as tx:
            letter_id = tx.add_dead_letter(letter)
        stored = store.get_dead_letter(letter_id)
        assert stored is not None
        assert stored.message.payload == b"\xff\xfe\x00not utf-8\x80"
        assert stored == DeadLetter(
            group=unique,
            message=letter.message,
            token="tok-41",
            failure=letter.failure,
            id=letter_id,
            replays=0,
        )

    def test_list_page_count_and_delete(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(5)]
        assert store.count_dead_letters(unique) == 5
        assert [d.id for d in store.dead_letters(unique, limit=2)] == ids[:2]
        assert [d.id for d in store.dead_letters(unique, limit=10, after_id=ids[2])] == ids[3:]
        assert [d.message.offset for d in store.iter_dead_letters(unique, page=2)] == list(range(5))
        assert store.delete_dead_letters(ids[:2]) == 2
        assert store.get_dead_letter(ids[0]) is None
        assert store.count_dead_letters(unique) == 3

    def test_rollback_discards_the_dead_letter(self, store: Store, unique: str) -> None:
        with pytest.raises(Boom), store.transaction() as tx:
            tx.add_dead_letter(_letter(unique, 1, b"x"))
            raise Boom("rolled back")
        assert store.count_dead_letters(unique) == 0

    def test_replays_are_counted(self, store: Store, unique: str) -> None:
        assert isinstance(store, SqlStore)
        with store.transaction() as tx:
            letter_id = tx.add_dead_letter(_letter(unique, 1, b"x"))
        assert store.mark_replayed([letter_id]) == 1
        stored = store.get_dead_letter(letter_id)
        assert stored is not None and stored.replays == 1


class TestOffsets:
    def test_upsert_and_load(self, store: Store, unique: str) -> None:
        first, second = QueueRef("orders", 0), QueueRef("orders", 1)
        with store.transaction() as tx:
            tx.save_offsets(unique, {first: 10, second: 5})
        with store.transaction() as tx:
            tx.save_offsets(unique, {first: 12})
        assert store.load_offsets(unique) == {first: 12, second: 5}
        assert store.load_offsets(unique + "-other") == {}

    def test_offsets_roll_back_with_the_transaction(self, store: Store, unique: str) -> None:
        with pytest.raises(Boom), store.transaction() as tx:
            tx.save_offsets(unique, {QueueRef("orders", 0): 3})
            raise Boom("rolled back")
        assert store.load_offsets(unique) == {}


class TestOpening:
    def test_unreachable_database_is_unavailable(self) -> None:
        store = open_store("postgresql+psycopg://postgres@127.0.0.1:1/test")
        with pytest.raises(StoreUnavailableError) as raised, store.transaction():
            pass
        assert raised.value.__cause__ is not None
        with pytest.raises(StoreUnavailableError):
            store.known("group", ["a"])

    @pytest.mark.parametrize("url", ["mysql://u@h/db", "redis://127.0.0.1", "not a url"])
    def test_unknown_scheme_names_url_and_allowed(self, url: str) -> None:
        with pytest.raises(UnsupportedURLError) as raised:
            open_store(url)
        assert url in str(raised.value) and "postgresql+psycopg" in str(raised.value)

    def test_in_memory_sqlite_is_refused(self) -> None:
        with pytest.raises(ConfigurationError, match="in-memory"):
            open_store("sqlite://")

    def test_plain_postgresql_means_psycopg(self, postgres_url: str) -> None:
        store = open_store(postgres_url.replace("+psycopg", ""))
        assert isinstance(store, SqlStore) and store.url.drivername == "postgresql+psycopg"
        assert store.known("nobody", ["a"]) == set()
        store.close()

    def test_tables_exist_after_first_use(self, store: Store) -> None:
        assert isinstance(store, SqlStore)
        store.known("nobody", ["a"])
        with store.engine.connect() as connection:
            assert connection.execute(select(func.count()).select_from(text("reliable_fences")))


@pytest.mark.parametrize("size", [1, COPY_CLAIM_MIN], ids=["one-token", "copy-size"])
def test_connection_lost_mid_transaction_is_unavailable(
    postgres_url: str, unique: str, size: int
) -> None:
    store = open_store(postgres_url)
    batch = [f"a-{i}" for i in range(size)]
    with pytest.raises(StoreUnavailableError), store.transaction() as tx:
        pid = tx.execute(text("SELECT pg_backend_pid()")).scalar_one()
        killer = SqlStore(postgres_url)
        with killer.engine.connect() as connection:
            connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        killer.close()
        tx.claim(unique, batch, TTL)
    with store.transaction() as tx:  # the pool recovers with a fresh connection
        assert tx.claim(unique, batch, TTL) == set(batch)
    store.close()


@pytest.mark.parametrize("size", [1, COPY_CLAIM_MIN], ids=["insert", "copy"])
def test_postgresql_refuses_a_token_with_a_nul_whichever_way_it_claims(
    postgres_url: str, unique: str, size: int
) -> None:
    store = open_store(postgres_url)
    batch = ["nul\x00inside", *(f"p-{i:05d}" for i in range(size))]
    with pytest.raises(DataError, match="NUL"), store.transaction() as tx:
        tx.claim(unique, batch, TTL)
    assert store.known(unique, batch[1:]) == set()  # nothing of the batch stays
    store.close()


def test_sqlite_parent_directory_is_created(tmp_path: Path, unique: str) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'store.db'}")
    with store.transaction() as tx:
        assert tx.claim(unique, ["a"], TTL) == {"a"}
    assert (tmp_path / "nested" / "dir" / "store.db").exists()
    store.close()


def test_postgresql_claims_large_all_new_batches_with_copy(
    postgres_url: str, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COPY path is taken for a large batch, given up after a conflict, and retried once a
    batch is all new again (the outcomes themselves are the contract tests above)."""
    from backends.store import postgresql

    outcomes: list[bool] = []
    real = postgresql.claim_by_copy

    def spy(*args: object) -> bool:
        outcomes.append(real(*args))  # type: ignore[arg-type]
        return outcomes[-1]

    monkeypatch.setattr(postgresql, "claim_by_copy", spy)
    store = open_store(postgres_url)
    batch = [f"p-{i:05d}" for i in range(COPY_CLAIM_MIN)]
    try:
        size = len(batch)
        for expected, tokens, new in (
            ([True], batch, size),  # all new: COPY
            ([True, False], [batch[0], *(t + "x" for t in batch[1:])], size - 1),  # one known
            ([True, False], [t + "y" for t in batch], size),  # all new, after a conflict: INSERT
            ([True, False, True], [t + "z" for t in batch], size),  # then COPY again
        ):
            with store.transaction() as tx:
                assert len(tx.claim(unique, tokens, TTL)) == new
            assert outcomes == expected
    finally:
        store.close()


class TestDeadLettersOnce:
    def test_the_same_message_is_recorded_once_per_replay_count(self, store: Store, unique: str) -> None:
        letter = _letter(unique, 7, b"x")
        with store.transaction() as tx:
            first = tx.add_dead_letter(letter)
        with store.transaction() as tx:  # a duplicate of it, or its redelivery after a crash
            assert tx.add_dead_letter(letter) is None
        with store.transaction() as tx:  # failed again after a replay: a record of its own
            again = tx.add_dead_letter(DeadLetter(unique, letter.message, letter.token, letter.failure, replays=1))
        assert first is not None and again is not None and again != first
        assert store.count_dead_letters(unique) == 2

    def test_ids_are_never_reused_after_a_purge(self, store: Store, unique: str) -> None:
        with store.transaction() as tx:
            ids = [tx.add_dead_letter(_letter(unique, offset, b"{}")) for offset in range(3)]
        assert store.delete_dead_letters([i for i in ids if i is not None]) == 3
        with store.transaction() as tx:
            later = tx.add_dead_letter(_letter(unique, 9, b"{}"))
        assert later is not None and later > max(i for i in ids if i is not None)
