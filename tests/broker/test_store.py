"""The store's public API: append, read, lookups, offsets, errors, flush policies."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from storetools import read_all, record_for, segments, small_config

from broker.errors import (
    BrokerConfigError,
    InvalidRecordError,
    InvalidRequestError,
    RecordTooLargeError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from broker.store import FakeClock, FlushPolicy, MessageStore, Record, StoreConfig
from broker.store.segment import Segment


@pytest.fixture
def store(tmp_path: Path):
    with MessageStore(tmp_path / "store", small_config()) as opened:
        yield opened


def test_append_then_read_returns_every_field(store: MessageStore) -> None:
    record = Record("orders", 2, b"\x00body", key="k1", tag="red", headers={"h": "v"},
                    message_id="m-1", attempt=3)
    [placed] = store.append([record])
    [message] = store.read("orders", 2, 0, 10)
    assert (placed.topic, placed.queue, placed.queue_offset, placed.message_id) == (
        "orders", 2, 0, "m-1")
    assert message.body == b"\x00body" and message.key == "k1" and message.tag == "red"
    assert message.headers == {"h": "v"} and message.attempt == 3
    assert message.log_offset == placed.log_offset
    assert message.store_time == store.config.clock.time()


def test_queue_offsets_count_per_queue_and_reads_page(store: MessageStore) -> None:
    placed = store.append([record_for(f"m{i}", "orders", i % 3) for i in range(90)])
    assert [p.queue_offset for p in placed if p.queue == 1] == list(range(30))
    assert store.max_offset("orders", 1) == 30 and store.max_offset("orders", 7) == 0
    page = store.read("orders", 1, 10, 5)
    assert [m.message_id for m in page] == [f"m{i}" for i in range(31, 46, 3)]
    assert store.read("orders", 1, 30, 5) == [] and store.read("nope", 0, 0, 5) == []


def test_records_roll_over_segments_named_by_base_offset(tmp_path: Path) -> None:
    with MessageStore(tmp_path / "s", small_config()) as store:
        placed = store.append([record_for(f"m{i}") for i in range(60)])
        files = segments(tmp_path / "s")
        assert len(files) > 2
        assert int(files[0].stem) == 0
        assert all(int(f.stem) in {p.log_offset for p in placed} for f in files)
        assert [m.message_id for m in read_all(store)] == [f"m{i}" for i in range(60)]


def test_generated_message_ids_are_unique_and_looked_up(store: MessageStore) -> None:
    placed = store.append([Record("t", 0, b"x") for _ in range(50)])
    ids = [p.message_id for p in placed]
    assert len(set(ids)) == 50
    found = store.lookup_id(ids[17])
    assert found is not None and found.queue_offset == 17
    assert store.lookup_id("missing") is None


def test_lookup_key_honours_topic_and_time_range(store: MessageStore) -> None:
    clock = store.config.clock
    assert isinstance(clock, FakeClock)
    start = clock.time()
    store.append([Record("a", 0, b"1", key="k"), Record("b", 0, b"2", key="k")])
    clock.advance(100)
    store.append([Record("a", 1, b"3", key="k"), Record("a", 1, b"4", key="other")])
    assert [m.body for m in store.lookup_key("a", "k", start, start + 200)] == [b"1", b"3"]
    assert [m.body for m in store.lookup_key("a", "k", start + 50, start + 200)] == [b"3"]
    assert [m.body for m in store.lookup_key("b", "k", start, start + 200)] == [b"2"]
    assert store.lookup_key("a", "k", start, start + 200, max_count=1)[0].body == b"3"


def test_data_survives_clean_reopen(tmp_path: Path) -> None:
    with MessageStore(tmp_path / "s", small_config()) as store:
        store.append([record_for(f"m{i}", "t", i % 2) for i in range(40)])
    with MessageStore(tmp_path / "s", small_config()) as store:
        assert len(read_all(store)) == 40
        [placed] = store.append([record_for("later", "t", 0)])
        assert placed.queue_offset == 20
        assert store.lookup_key("t", "key-m3", 0, 2e9)[0].message_id == "m3"


@pytest.mark.parametrize(
    ("record", "error", "text"),
    [
        (Record("a/b", 0, b""), InvalidRecordError, "topic 'a/b'"),
        (Record("", 0, b""), InvalidRecordError, "topic ''"),
        (Record("t", -1, b""), InvalidRecordError, "queue -1"),
        (Record("t", 0, "text"), InvalidRecordError, "must be bytes"),  # type: ignore[arg-type]
        (Record("t", 0, b"", attempt=-2), InvalidRecordError, "attempt=-2"),
        (Record("t", 0, b"x" * 9000), RecordTooLargeError, "max_record_size=8192"),
    ],
)
def test_bad_records_are_rejected_with_a_clear_error(
    store: MessageStore, record: Record, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text.replace("(", r"\(")):
        store.append([record_for("ok"), record])
    assert store.max_offset("orders", 0) == 0  # nothing of the batch was written


def test_bad_read_requests_and_closed_store(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "s", small_config())
    with pytest.raises(InvalidRequestError, match="queue_offset=-1"):
        store.read("t", 0, -1, 5)
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.append([record_for("x")])


def test_a_store_directory_is_opened_by_one_store_only(tmp_path: Path) -> None:
    with (
        MessageStore(tmp_path / "s", small_config()),
        pytest.raises(StoreLockedError, match="already open"),
    ):
        MessageStore(tmp_path / "s", small_config())


def test_bad_config_names_the_setting() -> None:
    with pytest.raises(BrokerConfigError, match="flush='sometimes'"):
        StoreConfig(flush="sometimes")  # type: ignore[arg-type]
    with pytest.raises(BrokerConfigError, match="clean_at=0.9"):
        StoreConfig(clean_at=0.9, force_at=0.8)
    with pytest.raises(BrokerConfigError, match="max_record_size"):
        StoreConfig(segment_size=8192, max_record_size=16384)


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The log offset each segment fsync covered, in order (Segment.fsync counted)."""
    ends: list[int] = []
    real_fsync = Segment.fsync

    def counting_fsync(self: Segment) -> None:
        end = self.end
        real_fsync(self)
        ends.append(end)

    monkeypatch.setattr(Segment, "fsync", counting_fsync)
    return ends


def test_sync_acks_only_after_fsync_and_producers_share_fsyncs(
    tmp_path: Path, fsynced: list[int]
) -> None:
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.SYNC,
                                                      segment_size=1 << 20))
    early: list[int] = []

    def produce(thread: int) -> None:
        for n in range(25):
            [placed] = store.append([record_for(f"{thread}-{n}", "t", thread % 4)])
            if max(fsynced, default=-1) < placed.log_offset + placed.size:
                early.append(placed.log_offset)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fsyncs_for_appends = len(fsynced)
    assert not early, "an append returned before an fsync covered it"
    assert fsyncs_for_appends < 16 * 25, "group commit should share fsyncs between producers"
    assert len(read_all(store)) == 400
    store.close()


@pytest.mark.parametrize("policy", list(FlushPolicy))
def test_every_flush_policy_keeps_data_across_reopen(tmp_path: Path, policy: FlushPolicy) -> None:
    config = small_config(flush=policy, flush_interval=0.01, checkpoint_interval=0.01)
    with MessageStore(tmp_path / "s", config) as store:
        store.append([record_for(f"m{i}", "t", i % 2) for i in range(30)])
        assert len(read_all(store)) == 30
    with MessageStore(tmp_path / "s", config) as store:
        assert len(read_all(store)) == 30


def test_readers_see_consistent_messages_while_writers_append(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.ASYNC,
                                                      segment_size=64 * 1024))
    problems: list[str] = []
    done = threading.Event()

    def write(thread: int) -> None:
        for n in range(20):
            store.append([record_for(f"{thread}-{n}-{i}", "t", thread) for i in range(5)])

    def read(queue: int) -> None:
        offset = 0
        while not done.is_set() or offset < store.max_offset("t", queue):
            for message in store.read("t", queue, offset, 16):
                if message.queue_offset != offset or message.body != record_for(
                        message.message_id).body:
                    problems.append(f"{queue}@{offset}: {message.message_id}")
                offset += 1

    readers = [threading.Thread(target=read, args=(q,)) for q in (0, 1)]
    writers = [threading.Thread(target=write, args=(t,)) for t in (0, 1)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    for thread in readers:
        thread.join()
    assert not problems
    assert store.max_offset("t", 0) == store.max_offset("t", 1) == 100
    store.close()


def test_group_commit_gives_each_producer_its_own_results_or_error(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.SYNC,
                                                      segment_size=1 << 20))
    problems: list[str] = []
    refused: list[int] = []
    start = threading.Barrier(12)

    def produce(thread: int) -> None:
        start.wait()
        for n in range(20):
            batch = [record_for(f"{thread}-{n}-{i}", "t", thread % 3) for i in range(3)]
            if thread % 4 == 0 and n % 5 == 0:
                batch[1] = Record("bad/topic", 0, b"x")
                with pytest.raises(InvalidRecordError, match="bad/topic"):
                    store.append(batch)
                refused.append(thread)
                continue
            placed = store.append(batch)
            if [p.message_id for p in placed] != [r.message_id for r in batch]:
                problems.append(f"{thread}-{n}: {[p.message_id for p in placed]}")

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems
    assert len(refused) == 3 * 4
    stored = [m.message_id for m in read_all(store)]
    assert len(stored) == (12 * 20 - 12) * 3 == len(set(stored))
    assert not any(m.topic == "bad/topic" for m in read_all(store))
    store.close()


def test_async_producers_share_fsyncs_and_are_acked_only_after_them(
    tmp_path: Path, fsynced: list[int]
) -> None:
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.SYNC,
                                                      segment_size=1 << 20))
    early: list[int] = []

    async def produce(task: int) -> None:
        for n in range(25):
            [placed] = await store.append_async([record_for(f"{task}-{n}", "t", task % 4)])
            if max(fsynced, default=-1) < placed.log_offset + placed.size:
                early.append(placed.log_offset)

    async def main() -> None:
        await asyncio.gather(*(produce(task) for task in range(32)))

    asyncio.run(main())
    assert not early, "an async append returned before an fsync covered it"
    assert len(fsynced) < 32 * 25 / 4, "tasks on one loop should share fsyncs"
    stored = read_all(store)
    assert sorted(m.message_id for m in stored) == sorted(
        f"{task}-{n}" for task in range(32) for n in range(25))
    assert all(m.body == record_for(m.message_id).body for m in stored)
    store.close()


def test_async_append_gives_each_task_its_own_result_or_error(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.SYNC))

    async def main() -> list[object]:
        good = store.append_async([record_for("good")])
        bad = store.append_async([record_for("fine"), Record("bad/topic", 0, b"x")])
        return await asyncio.gather(good, bad, return_exceptions=True)

    placed, error = asyncio.run(main())
    assert isinstance(placed, list) and placed[0].message_id == "good"
    assert isinstance(error, InvalidRecordError) and "bad/topic" in str(error)
    assert [m.message_id for m in read_all(store)] == ["good"]
    store.close()


def test_cancelled_async_append_still_lands_and_closed_store_refuses(tmp_path: Path) -> None:
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.SYNC))

    async def main() -> None:
        task = asyncio.create_task(store.append_async([record_for("cancelled")]))
        await asyncio.sleep(0)  # queued with the committer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.append_async([record_for("after")])  # the committer carried on

    asyncio.run(main())
    assert sorted(m.message_id for m in read_all(store)) == ["after", "cancelled"]
    store.close()
    with pytest.raises(StoreClosedError):
        asyncio.run(store.append_async([record_for("late")]))


def test_a_failed_fsync_fails_every_waiting_task_and_the_appends_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that reports an I/O error on fsync (injected: a real one cannot be made to on
    demand): no task is told its records are safe, and the store takes nothing more."""
    store = MessageStore(tmp_path / "s", small_config(flush=FlushPolicy.SYNC))
    store.append([record_for("before")])

    def failing_fsync(self: Segment) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Segment, "fsync", failing_fsync)

    async def main() -> list[object]:
        return await asyncio.gather(*(store.append_async([record_for(f"t{n}")]) for n in range(8)),
                                    return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(outcome, StoreError) for outcome in outcomes), outcomes
    with pytest.raises(StoreError):
        store.append([record_for("after")])
    store.close()


@pytest.mark.parametrize("policy", [FlushPolicy.ASYNC, FlushPolicy.NONE])
def test_async_append_writes_inline_without_group_commit(tmp_path: Path,
                                                         policy: FlushPolicy) -> None:
    with MessageStore(tmp_path / "s", small_config(flush=policy)) as store:
        placed = asyncio.run(store.append_async([record_for("a"), record_for("b")]))
        assert [p.queue_offset for p in placed] == [0, 1]
        assert asyncio.run(store.append_async([])) == []
        assert [m.message_id for m in read_all(store)] == ["a", "b"]
