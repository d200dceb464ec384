"""The ack journal: under ``flush = "sync"`` an ack returned is an ack kept through a crash.

`Broker.abandon` stops as a killed process would: no offsets saved, no
checkpoint, so only what the journal fsynced speaks for the acks.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import broker.delivery.membership as membership_module
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.store import StoreConfig

ACKED = {0, 1, 2, 5, 7}  # out of order: the committed offset stops at 3


def _open(path: Path) -> Broker:
    return Broker(path, DeliveryConfig(queues=1), store_config=StoreConfig(flush="sync"))


def _ack_some(path: Path) -> Broker:
    broker = _open(path)
    broker.publish("t", [OutgoingMessage(f"m{n}".encode(), message_id=f"m{n}") for n in range(10)])
    member = broker.join("g", ["t"])
    deliveries = broker.fetch(member, 10, 1.0)
    assert [d.offset for d in deliveries] == list(range(10))
    broker.ack(member, [d.receipt for d in deliveries if d.offset in ACKED])
    return broker


def _after_restart(path: Path) -> list[int]:
    broker = _open(path)
    try:
        member = broker.join("g", ["t"])
        return [d.offset for d in broker.fetch(member, 20, 0.2)]
    finally:
        broker.close()


def test_acks_survive_a_crash_even_out_of_order(tmp_path):
    _ack_some(tmp_path).abandon()
    assert not (tmp_path / "delivery" / "offsets.json").exists()  # only the journal speaks
    assert _after_restart(tmp_path) == [3, 4, 6, 8, 9]


def test_a_torn_last_line_is_ignored(tmp_path):
    _ack_some(tmp_path).abandon()
    with open(tmp_path / "delivery" / "acks.journal", "ab") as journal:
        journal.write(b'["g","t",0,[3,4')  # a write the kill cut: its ack was never confirmed
    broker = _open(tmp_path)  # the torn tail is cut: the next ack's line must not join it
    member = broker.join("g", ["t"])
    deliveries = broker.fetch(member, 20, 0.2)
    assert [d.offset for d in deliveries] == [3, 4, 6, 8, 9]
    broker.ack(member, [deliveries[0].receipt])
    broker.abandon()
    assert _after_restart(tmp_path) == [4, 6, 8, 9]


def test_a_seek_back_forgets_the_acks_before_it(tmp_path):
    broker = _ack_some(tmp_path)
    broker.leave(broker.join("g", ["t"]))  # a second member: the first one keeps the only queue
    (first,) = broker.consuming.membership.group_table["g"].members
    broker.commit(first, {("t", 0): 0})
    broker.abandon()
    assert _after_restart(tmp_path) == list(range(10))


def test_compaction_keeps_the_acks_above_the_committed_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(membership_module, "COMPACT_BYTES", 0)
    broker = _ack_some(tmp_path)
    broker.save_offsets()
    lines = (tmp_path / "delivery" / "acks.journal").read_bytes().splitlines()
    assert lines == [b'["g","t",0,[5,7]]']  # 0-2 moved into offsets.json
    broker.abandon()
    assert _after_restart(tmp_path) == [3, 4, 6, 8, 9]


@pytest.mark.parametrize("flush", ["async"])
def test_async_keeps_no_journal(tmp_path, flush):
    broker = Broker(tmp_path, store_config=StoreConfig(flush=flush))
    assert broker.consuming.membership.acks is None
    broker.close()
    assert not (tmp_path / "delivery" / "acks.journal").exists()


def test_acks_ride_the_appends_group_commit_and_fail_alone(tmp_path):
    """One committer thread serves appends and acks; a journal that cannot be written fails
    the ack, not the publishes of the same passes."""
    broker = _open(tmp_path)
    try:
        broker.publish("t", [OutgoingMessage(b"m", message_id="m")])
        member = broker.join("g", ["t"])
        [delivery] = broker.fetch(member, 1, 1.0)
        threads = {thread.name for thread in threading.enumerate()}
        assert "store-committer" in threads and "broker-ack-journal" not in threads
        read_only = os.open(tmp_path / "delivery" / "acks.journal", os.O_RDONLY)
        os.dup2(read_only, broker.consuming.membership.acks._fd)  # a real OSError (EBADF) at the journal's next write
        os.close(read_only)
        with pytest.raises(OSError):
            broker.ack(member, [delivery.receipt])
        [placed] = broker.publish("t", [OutgoingMessage(b"after", message_id="after")])
        assert placed.offset == 1  # the appends of the next passes are durable and confirmed
    finally:
        broker.abandon()
