"""Benchmark of the broker's message store (issue 4).

Measures, in one run and on one disk: the raw fsync rate and raw buffered
write rate of the machine, `sync` appends with 1, 8 and 64 concurrent producers (group commit; 1, 10
or 32 records per append call, as each row says), as threads calling
`append` and as asyncio tasks awaiting `append_async`,
`async` and `none` appends (batches of 100 records per call), reads, and
recovery of a large log. Bodies are 256 bytes. Prints a Markdown table and the
load average before and after (other processes share the machine).

    .venv/bin/python benchmarks/store.py                 # full run, 1 GB recovery log
    .venv/bin/python benchmarks/store.py --log-mb 64 --seconds 1   # quick run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from broker.store import FlushPolicy, MessageStore, Record, RecordColumns, StoreConfig
from broker.store.checkpoint import MARKER
from broker.store.commitlog import CommitLog
from broker.store.prepare import prepare
from broker.store.queues import QueueTable
from broker.store.recent import RecentRecords
from broker.store.segment import Segment
from broker.store.writer import BatchWriter

BODY = os.urandom(256)
BATCH = 100


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds else 0.0


def timed(seconds: float, step: Callable[[], int]) -> float:
    """Run ``step`` (returns how many operations it did) for ``seconds``; operations per second."""
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        done += step()
    return rate(done, elapsed)


def raw_fsync(directory: Path, seconds: float) -> float:
    fd = os.open(directory / "raw-fsync", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    record = BODY + bytes(64)

    def step() -> int:
        os.write(fd, record)
        os.fsync(fd)
        return 1

    try:
        return timed(seconds, step)
    finally:
        os.close(fd)


def raw_buffered(directory: Path, seconds: float) -> float:
    record = BODY + bytes(64)
    with open(directory / "raw-buffered", "wb") as f:
        write = f.write

        def step() -> int:
            for _ in range(1000):
                write(record)
            return 1000

        return timed(seconds, step)


@contextlib.contextmanager
def counting_fsyncs() -> Iterator[list[int]]:
    """Count the store's log fsyncs (to show how many records one fsync covers)."""
    count = [0]
    real = Segment.fsync

    def counted(segment: Segment) -> None:
        count[0] += 1
        real(segment)

    Segment.fsync = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        Segment.fsync = real  # type: ignore[method-assign]


def records(count: int, producer: int = 0) -> list[Record]:
    return [Record("bench", (producer + i) % 8, BODY, key=f"k{producer}-{i}") for i in range(count)]


def appends(directory: Path, policy: FlushPolicy, producers: int, batch: int, seconds: float) -> float:
    store = MessageStore(directory, StoreConfig(flush=policy))
    counts = [0] * producers
    stop = threading.Event()

    def produce(index: int) -> None:
        batch_records = records(batch, index)
        while not stop.is_set():
            store.append(batch_records)
            counts[index] += batch

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    store.close()
    return rate(sum(counts), elapsed)


def async_appends(directory: Path, producers: int, batch: int, seconds: float) -> float:
    """`sync` appends from ``producers`` asyncio tasks on one event loop (as the broker's server
    runs its connections): each awaits `MessageStore.append_async`."""
    store = MessageStore(directory, StoreConfig(flush=FlushPolicy.SYNC))
    counts = [0] * producers
    stop = asyncio.Event()

    async def produce(index: int) -> None:
        batch_records = records(batch, index)
        while not stop.is_set():
            await store.append_async(batch_records)
            counts[index] += batch

    async def run() -> float:
        tasks = [asyncio.create_task(produce(i)) for i in range(producers)]
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        return time.perf_counter() - start

    elapsed = asyncio.run(run())
    store.close()
    return rate(sum(counts), elapsed)


def reads(directory: Path, seconds: float) -> float:
    store = MessageStore(directory, StoreConfig())
    places = store.queues()
    positions = dict.fromkeys(places, 0)

    def step() -> int:
        done = 0
        for place in places:
            batch = store.read(*place, positions[place], 32)
            positions[place] = batch[-1].queue_offset + 1 if batch else 0
            done += len(batch)
        return done

    try:
        return timed(seconds, step)
    finally:
        store.close()


def write_log(directory: Path, megabytes: int) -> int:
    """Write ``megabytes`` of 256-byte-body records straight into commit-log segments.

    Uses the store's own batch writer and codec, but no key index and throw-away
    consume queues, so that opening the directory afterwards is a full rebuild.
    """
    config = StoreConfig()
    commit_log = CommitLog(directory / "commitlog", config.segment_size, fsync_on_roll=False)
    queues = QueueTable(directory / "scratch", 1 << 16)
    writer = BatchWriter(commit_log, queues, _NoIndex(), b"bench000",  # type: ignore[arg-type]
                         RecentRecords(0))
    batch = prepare(RecordColumns.of(records(1000)), config.max_record_size)
    count, target = 0, megabytes * 1024 * 1024
    while commit_log.end < target:
        writer.write(batch, time.time())
        count += len(batch.sizes)
    for segment in commit_log.segments:
        segment.fsync()
    commit_log.close()
    queues.close()
    shutil.rmtree(directory / "scratch")
    return count


class _NoIndex:
    """Stands in for the key index while the raw log is generated (recovery builds the real one)."""

    def add_many(self, *columns: object) -> None:
        pass

    def advance(self, end: int) -> None:
        pass


def crash_after_appending(directory: Path, seconds: float, machine: bool) -> tuple[int, float]:
    """Append for ``seconds`` with no checkpoint, crash, and time the reopen."""
    store = MessageStore(directory, StoreConfig(checkpoint_interval=0))
    batch = records(BATCH)
    appended, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        store.append(batch)
        appended += BATCH
    store._shutdown(clean=False)
    if machine:
        (directory / MARKER).write_text("")  # as if the machine, not the process, had crashed
    start = time.perf_counter()
    MessageStore(directory, StoreConfig()).close()
    return appended, time.perf_counter() - start


def recovery(directory: Path, megabytes: int) -> dict[str, float]:
    count = write_log(directory, megabytes)
    results: dict[str, float] = {"records": count}
    start = time.perf_counter()
    store = MessageStore(directory, StoreConfig())  # no checkpoint, no queues, no index
    results["full_rebuild_s"] = time.perf_counter() - start
    store.close()
    results["since_checkpoint"], results["crash_recovery_s"] = crash_after_appending(
        directory, 1.0, machine=False)
    results["machine_since_checkpoint"], results["machine_crash_recovery_s"] = (
        crash_after_appending(directory, 1.0, machine=True))
    start = time.perf_counter()
    MessageStore(directory, StoreConfig()).close()
    results["clean_open_s"] = time.perf_counter() - start
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each rate")
    parser.add_argument("--log-mb", type=int, default=1024, help="size of the recovery log")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    root = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.dir))
    load_before = os.getloadavg()
    rows: list[tuple[str, str, str]] = []
    try:
        fsyncs = raw_fsync(root, args.seconds)
        rows.append(("raw fsync (write 320 B + fsync)", f"{fsyncs:,.0f} /s", "baseline"))
        buffered = raw_buffered(root, args.seconds)
        rows.append(("raw buffered write (320 B records)", f"{buffered:,.0f} /s", "baseline"))
        for producers, batch in ((1, 1), (8, 1), (64, 1), (64, 10), (64, 32)):
            fsyncs = raw_fsync(root, args.seconds)  # the disk's rate drifts: measure it right before
            with counting_fsyncs() as count:
                value = appends(root / f"sync{producers}-{batch}", FlushPolicy.SYNC, producers,
                                batch, args.seconds)
            per_fsync = value * args.seconds / max(count[0], 1)
            rows.append((f"append sync, {producers} producers, {batch} record(s)/call",
                         f"{value:,.0f} msg/s",
                         f"{value / fsyncs:.1f}x raw fsync ({fsyncs:,.0f}/s just before); "
                         f"{per_fsync:.1f} records per fsync"))
        for producers, batch in ((1, 1), (8, 1), (64, 1), (64, 10)):
            fsyncs = raw_fsync(root, args.seconds)
            with counting_fsyncs() as count:
                value = async_appends(root / f"async-tasks{producers}-{batch}", producers, batch,
                                      args.seconds)
            per_fsync = value * args.seconds / max(count[0], 1)
            rows.append((f"append sync, {producers} asyncio tasks, {batch} record(s)/call",
                         f"{value:,.0f} msg/s",
                         f"{value / fsyncs:.1f}x raw fsync ({fsyncs:,.0f}/s just before); "
                         f"{per_fsync:.1f} records per fsync"))
        value = appends(root / "none64", FlushPolicy.NONE, 64, 1, args.seconds)
        rows.append(("append none, 64 producers, 1 record/call", f"{value:,.0f} msg/s",
                     f"{value / fsyncs:.1f}x raw fsync; no group commit under `none`: each call "
                     "encodes and writes under the writer lock"))
        for policy in (FlushPolicy.ASYNC, FlushPolicy.NONE):
            value = appends(root / policy.value, policy, 1, BATCH, args.seconds)
            rows.append((f"append {policy.value}, 1 producer, {BATCH} records/call",
                         f"{value:,.0f} msg/s", f"{value / buffered:.2f}x raw buffered"))
        value = reads(root / "async", args.seconds)
        rows.append(("read, 8 queues, 32 messages/call", f"{value:,.0f} msg/s", ""))
        found = recovery(root / "recovery", args.log_mb)
        label = f"{args.log_mb} MB log, {found['records']:,.0f} records"
        rows.append((f"recovery after kill -9, {label}", f"{found['crash_recovery_s']:.2f} s",
                     f"{found['since_checkpoint']:,.0f} records (1 s) after the checkpoint"))
        rows.append((f"recovery after machine crash, {label}",
                     f"{found['machine_crash_recovery_s']:.2f} s",
                     f"{found['machine_since_checkpoint']:,.0f} records after the checkpoint; "
                     "open index file re-indexed"))
        rows.append((f"full rebuild (no checkpoint, queues, index), {label}",
                     f"{found['full_rebuild_s']:.2f} s", "worst case"))
        rows.append((f"clean open, {label}", f"{found['clean_open_s']:.2f} s", ""))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| measurement | result | note |\n|---|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\nload average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
