"""Bounded memory: recovery and reads hold the same few megabytes for 10x the messages."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from storetools import small_config

from broker.store import MessageStore, Record
from broker.store.checkpoint import CHECKPOINT, MARKER

BODY = bytes(range(256))


def peak_bytes(directory: Path, count: int) -> tuple[int, int]:
    """Peak Python memory of a full-replay recovery, and of reading one page at the end."""
    config = small_config(segment_size=1 << 20, read_chunk=64 * 1024,
                          queue_file_entries=4096, index_entries=8192, index_slots=2048)
    with MessageStore(directory, config) as store:
        for start in range(0, count, 500):
            store.append([Record("t", i % 4, BODY, key=f"k{i}") for i in range(start, start + 500)])
    (directory / CHECKPOINT).unlink()
    (directory / MARKER).write_text("")
    tracemalloc.start()
    store = MessageStore(directory, config)
    _, recovery_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    assert len(store.read("t", 3, count // 4 - 32, 32)) == 32
    _, read_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert store.recovery.records_replayed == count
    store.close()
    return recovery_peak, read_peak


def test_memory_does_not_grow_with_the_number_of_messages(tmp_path: Path) -> None:
    small_recovery, small_read = peak_bytes(tmp_path / "small", 2_000)
    large_recovery, large_read = peak_bytes(tmp_path / "large", 20_000)
    assert large_recovery < small_recovery + 1_000_000
    assert large_read < small_read + 100_000
    assert large_recovery < 4_000_000
