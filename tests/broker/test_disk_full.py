"""A full disk, for real: the store's files on a small tmpfs the test mounts, then fills.

Once a write hit ENOSPC the store used to refuse every publish and every read
until it was reopened, and the publish its producer was told had failed was
partly stored (5 of 7 records after a restart). Here, on a 24 MiB tmpfs:
appends that hit ENOSPC fail whole, reads go on, the next append succeeds
once space is back, and after a crash and a reopen the store holds exactly
the acknowledged records, the failed batch absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.errors import DiskFullError
from broker.store import MessageStore, Record
from tests.broker.storetools import read_all, small_config
from tests.disk import fill

ROOM = 100 * 1024  # what is left free: the first records of a failed batch are written, then cut back


def batch(name: str, count: int, size: int) -> list[Record]:
    return [Record("orders", n % 4, os.urandom(size), message_id=f"{name}-{n}", key=f"k{n}")
            for n in range(count)]


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_full_disk_refuses_whole_batches_keeps_reading_and_recovers_without_restart(
        small_disk: Path, flush: str) -> None:
    config = small_config(flush=flush, segment_size=1024 * 1024, max_record_size=64 * 1024,
                          queue_file_entries=4096, index_slots=256, index_entries=4096,
                          disk_usage=lambda path: 0.0)  # the 90% guard is not what is tested here
    store = MessageStore(small_disk / "store", config)
    acknowledged = [r.message_id for r in batch("before", 200, 1000)]
    store.append(batch("before", 200, 1000))
    ballast = fill(small_disk)
    assert ballast.hit_enospc
    ballast.leave(ROOM)  # room for part of the next batch
    log_files = {p: p.stat().st_size for p in (small_disk / "store" / "commitlog").iterdir()}
    for attempt in range(5):  # each batch is larger than the room left: ENOSPC in its middle
        with pytest.raises(DiskFullError, match="disk is full"):
            store.append(batch(f"failed{attempt}", 7, 40_000))
        assert sorted(m.message_id for m in read_all(store)) == sorted(acknowledged)
        assert {p: p.stat().st_size for p in (small_disk / "store" / "commitlog").iterdir()} == log_files
    assert store.lookup_id("before-7") is not None
    ballast.free()
    store.append(batch("after", 50, 1000))
    acknowledged += [f"after-{n}" for n in range(50)]
    assert sorted(m.message_id for m in read_all(store)) == sorted(acknowledged)
    store._shutdown(clean=False)  # as a crash leaves the files
    reopened = MessageStore(small_disk / "store", config)
    try:
        stored = sorted(m.message_id for m in read_all(reopened))
        assert stored == sorted(acknowledged)
        assert not any(message_id.startswith("failed") for message_id in stored)
        assert all(reopened.lookup_id(f"failed{a}-{n}") is None for a in range(5) for n in range(7))
    finally:
        reopened.close()
