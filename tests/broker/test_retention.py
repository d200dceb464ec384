"""Retention: expired segments, disk thresholds, consumer groups' needs, refused writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from storetools import read_all, record_for, segments, small_config
from structlog.testing import capture_logs

from broker.errors import BrokerConfigError, DiskFullError
from broker.store import FakeClock, MessageStore, StoreConfig


class Disk:
    """An injectable disk-usage gauge the test sets by hand."""

    def __init__(self) -> None:
        self.usage = 0.10

    def __call__(self, path: Path) -> float:
        return self.usage


def fill(store: MessageStore, count: int = 60, prefix: str = "m") -> None:
    store.append([record_for(f"{prefix}{i}", "orders", i % 2) for i in range(count)])


def test_expired_segments_are_deleted_but_never_the_active_one(tmp_path: Path) -> None:
    clock = FakeClock()
    with MessageStore(tmp_path / "s", small_config(clock=clock, retention=3600)) as store:
        fill(store, prefix="old")
        clock.advance(3000)
        fill(store, prefix="new")
        assert store.clean() == []
        clock.advance(1000)  # "old" segments now older than an hour; "new" are not
        with capture_logs() as logs:
            deleted = store.clean()
        assert deleted and all(d.reason == "expired" for d in deleted)
        assert {e["event"] for e in logs} == {"store.segment_deleted"}
        remaining = read_all(store)
        assert any(m.message_id.startswith("new") for m in remaining)
        assert {f"new{i}" for i in range(60)} <= {m.message_id for m in remaining}
        for queue in (0, 1):
            first = store.min_offset("orders", queue)
            assert first > 0
            assert store.read("orders", queue, first, 1)[0].queue_offset == first
            assert store.read("orders", queue, 0, 1)[0].queue_offset == first
        clock.advance(10_000)
        store.clean()
        assert len(segments(tmp_path / "s")) == 1  # the active segment stays


def test_disk_thresholds_respect_what_groups_need_until_forced(tmp_path: Path) -> None:
    disk = Disk()
    config = small_config(disk_usage=disk, retention=0, force_at=0.85)
    with MessageStore(tmp_path / "s", config) as store:
        fill(store)
        store.set_retention_guard(lambda: {("orders", 0): 0})  # a group still at offset 0
        before = len(segments(tmp_path / "s"))
        disk.usage = 0.78  # clean level: only what no group needs
        assert store.clean() == []
        store.set_retention_guard(lambda: {("orders", 0): store.max_offset("orders", 0) - 1})
        cleaned = store.clean()
        assert cleaned and {d.reason for d in cleaned} == {"disk_clean"}
        assert len(segments(tmp_path / "s")) < before
        store.set_retention_guard(lambda: {("orders", 1): 0})  # below what is left: clamped
        fill(store, prefix="more")
        disk.usage = 0.86  # force level: deleted even though a group needs it, and logged
        with capture_logs() as logs:
            forced = store.clean()
        assert forced and {d.reason for d in forced} == {"disk_force"}
        warning = [e for e in logs if e["event"] == "store.needed_messages_deleted"]
        assert warning and warning[0]["queues"] == ["orders/1"]
        assert len(segments(tmp_path / "s")) == 1


def test_by_default_a_full_disk_refuses_appends_and_keeps_what_groups_need(tmp_path: Path) -> None:
    """No forced deletion unless asked: producers stop, no group loses a message, and once the
    group has read on, retention frees the space and appends go on."""
    disk = Disk()
    with MessageStore(tmp_path / "s", small_config(disk_usage=disk, retention=0)) as store:
        fill(store)
        store.set_retention_guard(lambda: {("orders", 0): 0, ("orders", 1): 0})
        before = segments(tmp_path / "s")
        disk.usage = 0.99
        with capture_logs() as logs:
            assert store.clean() == []
            with pytest.raises(DiskFullError, match="consumer groups catching up"):
                store.append([record_for("refused")])
        assert segments(tmp_path / "s") == before
        assert not [e for e in logs if e["event"] == "store.needed_messages_deleted"]
        assert {f"m{i}" for i in range(60)} <= {m.message_id for m in read_all(store)}
        store.set_retention_guard(lambda: {(topic, queue): store.max_offset(topic, queue)
                                           for topic, queue in (("orders", 0), ("orders", 1))})
        cleaned = store.clean()
        assert cleaned and {d.reason for d in cleaned} == {"disk_clean"}
        disk.usage = 0.5  # what the deleted segments held is free again
        store.append([record_for("accepted")])
        assert store.lookup_id("accepted") is not None


def test_force_at_may_be_off_but_never_out_of_order() -> None:
    assert StoreConfig().force_at is None
    assert StoreConfig(force_at=0.85).force_at == 0.85
    with pytest.raises(BrokerConfigError, match=r"force_at=0\.95.*never delete what a group"):
        StoreConfig(force_at=0.95)  # above refuse_at=0.90
    with pytest.raises(BrokerConfigError, match=r"clean_at=0\.95"):
        StoreConfig(clean_at=0.95)  # above refuse_at, force_at off


@pytest.mark.parametrize("policy", ["none", "sync"])  # sync checks once per generation
def test_writes_are_refused_at_the_refuse_threshold_and_reads_go_on(
    tmp_path: Path, policy: str
) -> None:
    disk = Disk()
    with MessageStore(tmp_path / "s", small_config(disk_usage=disk, flush=policy)) as store:
        fill(store, count=4)
        disk.usage = 0.93
        with pytest.raises(DiskFullError, match=r"93\.0% full.*refuse_at=90%"):
            store.append([record_for("refused")])
        assert len(read_all(store)) == 4
        disk.usage = 0.5
        store.append([record_for("accepted")])
        assert store.lookup_id("accepted") is not None


def test_retention_removes_consume_queue_and_index_files_below_the_log(tmp_path: Path) -> None:
    clock = FakeClock()
    config = small_config(clock=clock, retention=60, queue_file_entries=4, index_entries=8)
    with MessageStore(tmp_path / "s", config) as store:
        fill(store, count=80, prefix="old")
        clock.advance(120)
        fill(store, count=10, prefix="new")
        queue_files = len(list((tmp_path / "s" / "consumequeue").rglob("*.cq")))
        index_files = len(list((tmp_path / "s" / "index").glob("*.idx")))
        store.clean()
        assert len(list((tmp_path / "s" / "consumequeue").rglob("*.cq"))) < queue_files
        assert len(list((tmp_path / "s" / "index").glob("*.idx"))) < index_files
        assert store.lookup_id("new9") is not None
    with MessageStore(tmp_path / "s", config) as store:
        assert {f"new{i}" for i in range(10)} <= {m.message_id for m in read_all(store)}
