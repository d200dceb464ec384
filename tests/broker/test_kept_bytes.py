"""The bytes each queue keeps: a running total kept on append, truncation and retention, and
recovered on open, that always equals the framed sizes of the messages a reader still gets."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from storetools import record_for, small_config

from broker.store import FakeClock, MessageStore
from broker.store.checkpoint import CHECKPOINT, MARKER

SIZES: dict[str, int] = {}  # the framed size of every record appended, by message id


def append(store: MessageStore, prefix: str, count: int) -> Counter[tuple[str, int]]:
    """Interleave ``count`` records over two topics' queues; the framed bytes per queue."""
    places = [("orders", 0), ("payments", 0), ("orders", 1)]
    records = [record_for(f"{prefix}{i}", *places[i % 3]) for i in range(count)]
    sizes: Counter[tuple[str, int]] = Counter()
    for record, result in zip(records, store.append(records)):
        sizes[(result.topic, result.queue)] += result.size
        SIZES[record.message_id] = result.size
    return sizes


def kept(store: MessageStore) -> dict[tuple[str, int], int]:
    return {place: store.kept_bytes(*place) for place in store.queues()}


def readable(store: MessageStore) -> dict[tuple[str, int], int]:
    """The framed size of every message a reader still gets, per queue."""
    return {place: sum(SIZES[m.message_id] for m in store.read(*place, 0, 10_000))
            for place in store.queues()}


def test_each_queue_counts_its_own_bytes_though_the_log_interleaves_them(tmp_path: Path) -> None:
    with MessageStore(tmp_path / "s", small_config()) as store:
        sizes = append(store, "a", 30) + append(store, "b", 31)
        assert kept(store) == dict(sizes)
        assert len(set(sizes.values())) == 3  # three different figures, not one shared total
        assert kept(store) == readable(store)


@pytest.mark.parametrize("how", ["clean", "crash", "crash_without_checkpoint", "old_checkpoint"])
def test_the_count_survives_a_restart(tmp_path: Path, how: str) -> None:
    """After a clean close, a crash with appends after the last checkpoint, a crash with no
    checkpoint at all, and a checkpoint written before counts were kept (every entry read once)."""
    with MessageStore(tmp_path / "s", small_config()) as store:
        sizes = append(store, "a", 40)
        store.checkpoint()
        sizes += append(store, "b", 20)
        if how != "clean":
            store._shutdown(clean=False)
    if how == "crash_without_checkpoint":
        (tmp_path / "s" / CHECKPOINT).unlink()
    if how == "old_checkpoint":
        saved = json.loads((tmp_path / "s" / CHECKPOINT).read_text())
        (tmp_path / "s" / CHECKPOINT).write_text(json.dumps({k: saved[k] for k in ("dispatched", "queues")}))
        (tmp_path / "s" / MARKER).touch()
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert store.recovery.crashed is (how != "clean")
        assert kept(store) == dict(sizes)
        sizes += append(store, "c", 9)
        assert kept(store) == dict(sizes)
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert kept(store) == dict(sizes)


def test_retention_takes_the_deleted_messages_off_and_a_restart_keeps_that(tmp_path: Path) -> None:
    clock = FakeClock()
    config = small_config(clock=clock, retention=3600)
    with MessageStore(tmp_path / "s", config) as store:
        before = append(store, "old", 60)
        clock.advance(4000)
        append(store, "new", 60)
        full = kept(store)
        assert store.clean()
        after = kept(store)
        assert all(after[place] < full[place] for place in before)  # every queue lost messages
        assert after == readable(store)
    with MessageStore(tmp_path / "s", config) as store:
        assert kept(store) == after == readable(store)
