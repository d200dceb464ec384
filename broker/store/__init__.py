"""The broker's storage layer, modelled on RocketMQ's.

One append-only commit log shared by all topics (segment files, CRC32C per
record), a consume queue of fixed-size entries per (topic, queue), a key index,
a checkpoint with crash recovery, and retention. Use `MessageStore`::

    with MessageStore("data/broker", StoreConfig(flush=FlushPolicy.SYNC)) as store:
        [placed] = store.append([Record("orders", 0, b"{...}", key="order-17")])
        messages = store.read("orders", 0, placed.queue_offset, max_count=32)
"""

from broker.store.clock import Clock, FakeClock, SystemClock
from broker.store.config import FlushPolicy, StoreConfig
from broker.store.record import (
    Appended,
    AppendResult,
    Record,
    RecordColumns,
    StoredBatch,
    StoredMessage,
)
from broker.store.retention import Deletion
from broker.store.store import MessageStore, RetentionGuard

__all__ = [
    "AppendResult",
    "Appended",
    "Clock",
    "Deletion",
    "FakeClock",
    "FlushPolicy",
    "MessageStore",
    "Record",
    "RecordColumns",
    "RetentionGuard",
    "StoreConfig",
    "StoredBatch",
    "StoredMessage",
    "SystemClock",
]
