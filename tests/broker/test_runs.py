"""Batch runs (`broker.store.runs`): ids ``<batch id>.0 ...`` indexed by a run's first id only.

Every id of a run is found, by its own index entry or by reading on from the
run's start: as the writer indexed it, after the index is rebuilt from the log,
and after a torn write cut a run whose resend appended the rest elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.store import MessageStore, Record, RecordColumns
from broker.store.runs import RunTracker, run_ids, split_run_id
from tests.broker.storetools import small_config


def run(batch_id: str, count: int, first: int = 0, body: bytes = b"x") -> RecordColumns:
    """``count`` records of ``batch_id``'s run from ``first``, marked as the engine marks them."""
    return RecordColumns(["orders"] * count, [0] * count, [body] * count, [""] * count, [""] * count,
                         [{}] * count, run_ids(batch_id, count, first), [0] * count,
                         [False] + [True] * (count - 1))


def ids_found(store: MessageStore, ids: list[str]) -> list[str | None]:
    return [found.message_id if (found := store.lookup_id(i)) else None for i in ids]


def index_entries(store: MessageStore) -> int:
    return sum(index_file.count for index_file in store._index.files)


@pytest.mark.parametrize(("message_id", "split"), [
    ("tok.0", ("tok", 0)), ("a.b.17", ("a.b", 17)), ("tok.10", ("tok", 10)),
    ("tok.01", None), ("tok.", None), (".3", None), ("tok", None), ("tok.-1", None), ("tok.٣", None),
])
def test_only_the_canonical_form_is_a_run_id(message_id: str, split: tuple[str, int] | None) -> None:
    assert split_run_id(message_id) == split


def test_recovery_continues_only_runs_begun_at_zero() -> None:
    tracker = RunTracker()
    ids = [b"t.0", b"t.1", b"t.2", b"other", b"t.3", b"u.1", b"u.2", b"v.0", b"v.1", b"v.01"]
    assert [tracker.continues(i) for i in ids] == [False, True, True, False, False, False, False,
                                                  False, True, False]


def test_a_run_is_indexed_by_its_first_id_and_every_id_is_found(tmp_path: Path) -> None:
    with MessageStore(tmp_path, small_config()) as store:
        store.append_columns(run("tok", 10))
        store.append([Record("orders", 0, b"between")])  # a store-made id: no entry either
        store.append_columns(run("tok", 3, first=10))
        store.append([Record("orders", 0, b"a", message_id="order.1"),
                      Record("orders", 0, b"b", message_id="order.2")])
        assert index_entries(store) == 4  # tok.0, tok.10, order.1, order.2
        wanted = [*run_ids("tok", 13), "order.1", "order.2"]
        assert ids_found(store, wanted) == wanted
        assert [m and m.message_id for m in store.lookup_run("tok", 15)] == [*run_ids("tok", 13), None, None]
        assert store.lookup_id("tok.13") is None and store.lookup_run("nope", 3) == [None] * 3


def test_the_index_rebuilt_from_the_log_finds_every_run_id(tmp_path: Path) -> None:
    with MessageStore(tmp_path, small_config()) as store:
        store.append_columns(run("tok", 10))
        store.append([Record("orders", 0, b"a", message_id="order.1"),
                      Record("orders", 0, b"b", message_id="order.2")])  # not a run: no .0
        store.append_columns(run("tok", 5, first=10))
    for index_file in tmp_path.rglob("*.idx"):
        index_file.unlink()
    with MessageStore(tmp_path, small_config()) as store:
        assert index_entries(store) == 1 + 2 + 5  # tok.0, both order ids, tok.10 .. tok.14
        wanted = [*run_ids("tok", 15), "order.1", "order.2"]
        assert ids_found(store, wanted) == wanted


@st.composite
def layouts(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Appends as publishes make them, in any order: batches from ``.0``, some cut short by a
    torn write and their tail appended by the resend; records whose own ids look like a run
    that begins past ``.0`` (two in one append); records with store-made ids."""
    appends: list[tuple[str, int, int]] = []  # (batch id, first position, count); count 0: plain
    for number in range(draw(st.integers(1, 6))):
        count = draw(st.integers(1, 12))
        kept = draw(st.integers(1, count))
        appends.append((f"b{number}", 0, kept))
        if kept < count:
            appends.append((f"b{number}", kept, count - kept))
    appends += [("", 0, 0)] * draw(st.integers(0, 3))
    appends += [(f"u{n}", 1, 2) for n in range(draw(st.integers(0, 3)))]
    return draw(st.permutations(appends))


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_every_id_of_any_layout_of_runs_is_found_before_and_after_the_index_is_rebuilt(
    tmp_path_factory: pytest.TempPathFactory, appends: list[tuple[str, int, int]]
) -> None:
    path = tmp_path_factory.mktemp("runs")
    written: list[str] = []
    with MessageStore(path, small_config()) as store:
        for batch_id, first, count in appends:
            if not count:
                store.append([Record("orders", 0, b"plain")])
            elif batch_id.startswith("u"):  # ids of their own, not marked as a run
                own = run_ids(batch_id, count, first)
                store.append([Record("orders", 0, b"own", message_id=i) for i in own])
                written += own
            else:
                store.append_columns(run(batch_id, count, first))
                written += run_ids(batch_id, count, first)
        assert ids_found(store, written) == written
    for index_file in path.rglob("*.idx"):
        index_file.unlink()
    with MessageStore(path, small_config()) as store:
        assert ids_found(store, written) == written
        for batch_id in {b for b, _, _ in appends if b.startswith("b")}:
            held = [m.message_id for m in store.lookup_run(batch_id, 12) if m]
            assert held == [i for i in run_ids(batch_id, 12) if i in written]
