"""A full disk, for real: the store's files on a small tmpfs the test mounts, then fills.

Once a write hit ENOSPC the store used to refuse every publish and every read
until it was reopened, and the publish its producer was told had failed was
partly stored (5 of 7 records after a restart). Here, on a 24 MiB tmpfs:
appends that hit ENOSPC fail whole, reads go on, the next append succeeds
once space is back, and after a crash and a reopen the store holds exactly
the acknowledged records, the failed batch absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.errors import DiskFullError
from broker.store import MessageStore, Record
from tests.broker.storetools import read_all, small_config
from tests.disk import fill
from tests.waiting import wait_until

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


def committed(broker_dir: Path) -> int | None:
    """The committed offset of group ``g`` on ``orders``/0 as ``offsets.json`` has it."""
    path = broker_dir / "delivery" / "offsets.json"
    if not path.exists():
        return None
    entries = json.loads(path.read_text())
    return next((e["offset"] for e in entries if e["group"] == "g" and e["topic"] == "orders"), None)


def test_offsets_acked_on_a_full_disk_are_written_once_space_is_back(small_disk: Path) -> None:
    broker_dir = small_disk / "broker"
    broker = Broker(broker_dir, DeliveryConfig(queues=1, offset_flush_interval=0.05),
                    store_config=small_config(disk_usage=lambda path: 0.0))
    try:
        broker.publish("orders", [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(10)])
        member = broker.join("g", ["orders"])
        deliveries = broker.fetch(member, 10, 0)
        broker.ack(member, [d.receipt for d in deliveries[:5]])
        wait_until(lambda: committed(broker_dir) == 5, "the first acks written")
        ballast = fill(small_disk)
        assert ballast.hit_enospc
        with capture_logs() as logs:
            broker.ack(member, [d.receipt for d in deliveries[5:]])
            wait_until(lambda: any(e["event"] == "delivery.offsets_not_saved" for e in logs),
                       "a flush refused by the full disk")
        assert committed(broker_dir) == 5
        ballast.free()
        wait_until(lambda: committed(broker_dir) == 10, "the acks of the full disk written once space is back")
    finally:
        broker.close()


def test_a_broker_closes_on_a_full_disk_and_opens_again(small_disk: Path) -> None:
    broker_dir = small_disk / "broker"
    config = DeliveryConfig(queues=1, offset_flush_interval=60.0)
    broker = Broker(broker_dir, config, store_config=small_config(disk_usage=lambda path: 0.0))
    broker.publish("orders", [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(10)])
    member = broker.join("g", ["orders"])
    deliveries = broker.fetch(member, 10, 0)
    broker.ack(member, [d.receipt for d in deliveries])
    ballast = fill(small_disk)
    assert ballast.hit_enospc
    with capture_logs() as logs:
        broker.close()  # the offsets cannot be written: said so, and the store is still closed
    assert any(e["event"] == "delivery.offsets_not_saved" and "No space left" in e["error"] for e in logs), logs
    assert any(e["event"] == "store.closed" and e["clean"] is False for e in logs), logs  # the lock released
    ballast.free()
    reopened = Broker(broker_dir, config, store_config=small_config(disk_usage=lambda path: 0.0))
    try:  # what was acked after the last written offsets comes back: at least once, never lost
        member = reopened.join("g", ["orders"])
        assert [d.message_id for d in reopened.fetch(member, 10, 0)] == [f"m{n}" for n in range(10)]
    finally:
        reopened.close()


def test_a_checkpoint_cut_short_by_a_nearly_full_disk_leaves_the_store_openable(small_disk: Path) -> None:
    config = small_config(disk_usage=lambda path: 0.0, queue_file_entries=64)
    store = MessageStore(small_disk / "store", config)
    store.append([Record("orders", n, b"x", message_id=f"m{n}") for n in range(400)])  # a 13 KiB checkpoint
    ballast = fill(small_disk)
    assert ballast.hit_enospc
    ballast.leave(4096)  # one page: the checkpoint's first write is short, the next one ENOSPC
    with capture_logs() as logs:
        store.close()
    assert any(e["event"] == "store.checkpoint_failed" for e in logs), logs
    ballast.free()
    reopened = MessageStore(small_disk / "store", config)  # before: CorruptStoreError, a 4096-byte checkpoint
    try:
        assert sorted(m.message_id for m in read_all(reopened)) == sorted(f"m{n}" for n in range(400))
    finally:
        reopened.close()


REOPEN = """
import sys
from broker.errors import DiskFullError
from broker.store import MessageStore
from tests.broker.storetools import small_config
try:
    MessageStore(sys.argv[1], small_config(disk_usage=lambda path: 0.0, queue_file_entries=300_000)).close()
except DiskFullError as exc:
    print(exc)
"""


def test_a_store_opens_on_a_full_disk_without_a_bus_error(small_disk: Path) -> None:
    config = small_config(disk_usage=lambda path: 0.0, queue_file_entries=300_000)  # sparse 4.8 MB queue files
    store = MessageStore(small_disk / "store", config)
    store.append(batch("before", 40, 100))
    store.close()
    ballast = fill(small_disk)
    assert ballast.hit_enospc
    # in a process of its own: a read of a file's hole through a shared map allocates it on
    # tmpfs, which on a full disk is a SIGBUS that kills the process
    opened = subprocess.run([sys.executable, "-c", REOPEN, str(small_disk / "store")], capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert opened.returncode == 0, f"exit {opened.returncode}: {opened.stderr[-2000:]}"
    assert "cannot be opened: the disk is full" in opened.stdout, opened.stdout  # it cannot mark itself open
    ballast.free()
    reopened = MessageStore(small_disk / "store", config)
    try:
        assert len(read_all(reopened)) == 40
    finally:
        reopened.close()


def test_acks_journaled_under_sync_flush_go_on_once_space_is_back(small_disk: Path) -> None:
    broker_dir, config = small_disk / "broker", DeliveryConfig(queues=1, offset_flush_interval=60.0)
    store_config = small_config(flush="sync", disk_usage=lambda path: 0.0)
    broker = Broker(broker_dir, config, store_config=store_config)
    broker.publish("orders", [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(600)])
    member = broker.join("g", ["orders"])
    deliveries = broker.fetch(member, 600, 0)
    ballast = fill(small_disk)
    assert ballast.hit_enospc
    refused = None
    for n in range(500):  # one journal line each: the journal soon needs a page the disk has not
        try:
            broker.ack(member, [deliveries[n].receipt])
        except OSError as exc:
            refused = n, exc
            break
    assert refused is not None and "No space left" in str(refused[1])
    ballast.free()
    broker.ack(member, [d.receipt for d in deliveries[refused[0] + 1 :]])  # before: refused from then on
    broker.abandon()  # a crash: what the journal holds is all there is
    reopened = Broker(broker_dir, config, store_config=store_config)
    try:
        member = reopened.join("g", ["orders"])
        again = [d.message_id for d in reopened.fetch(member, 600, 0)]
        assert again == [], again  # the refused ack's line was written with the next ones
    finally:
        reopened.close()
