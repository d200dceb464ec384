"""An embedded broker opened and closed again and again in one process gives everything back.

A process that opens ``embedded://DIR`` for a while and closes it (a test
suite, a CLI command run in a loop, a worker restarting its transport) must
not keep the closed engines: their file descriptors, threads and memory come
back after each close. Counted after a fixed number of cycles, never timed.
"""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc
import weakref
from pathlib import Path

import pytest

from broker.delivery.values import OutgoingMessage
from broker.embedded import EmbeddedBroker, open_embedded

CYCLES = 2000


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cycle(directory: Path, number: int) -> EmbeddedBroker:
    """Open the directory, publish, consume and ack one message, close; the closed broker."""
    broker = open_embedded(directory)
    broker.publish("orders", [OutgoingMessage(b"x" * 100, message_id=f"m{number}")])
    member = broker.join("billing", ["orders"])
    taken = broker.fetch(member, 10, 0)
    broker.ack(member, [delivery.receipt for delivery in taken])
    broker.leave(member)
    broker.close()
    return broker


def test_a_closed_embedded_broker_is_not_kept_alive(tmp_path: Path) -> None:
    closed = weakref.ref(cycle(tmp_path / "broker", 0))
    gc.collect()
    assert closed() is None, "a closed embedded broker is still referenced (its engine with it)"


@pytest.mark.soak
def test_open_close_cycles_return_fds_threads_and_memory(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    for number in range(20):  # warm-up: imports, caches, the first segment files
        cycle(directory, number)
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    tracemalloc.start()
    try:
        before = broker_memory(tracemalloc.take_snapshot())
        for number in range(20, 20 + CYCLES):
            cycle(directory, number)
        gc.collect()
        grown = broker_memory(tracemalloc.take_snapshot()) - before
    finally:
        tracemalloc.stop()
    assert open_fds() <= fds + 2, f"{open_fds() - fds} file descriptors more after {CYCLES} cycles"
    assert threading.active_count() <= threads, "threads left running by closed brokers"
    assert grown < 200 * CYCLES, f"the broker's code holds {grown} bytes more after {CYCLES} cycles"


def broker_memory(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes allocated by the broker's own code (pytest keeps every captured log line: not counted)."""
    return sum(stat.size for stat in snapshot.filter_traces([tracemalloc.Filter(True, "*/broker/*")]).statistics("filename"))
