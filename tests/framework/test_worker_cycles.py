"""A worker that sees many distinct keys, tokens and topics keeps its per-message state bounded.

Over a run of thousands of messages, each with a key and token of its own,
duplicates, poison messages and outbox rows to several topics, the worker's
Prometheus series stay the same set (no label carries a key, token or
message id), its threads and file descriptors come back, and no structlog
context is left bound. Counted after fixed runs, never timed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import structlog
from prometheus_client import REGISTRY
from sqlalchemy import text

from backends.clock import SYSTEM_CLOCK
from reliable.testing import test_app

pytestmark = pytest.mark.soak
ROUNDS, PER_ROUND = 4, 500


def series() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every sample of the framework's metrics, by name and labels."""
    return {(sample.name, tuple(sorted(sample.labels.items())))
            for family in REGISTRY.collect() if family.name.startswith("reliable")
            for sample in family.samples}


def test_many_distinct_keys_and_tokens_leave_the_worker_bounded(tmp_path: Path, unique: str) -> None:
    app = test_app(tmp_path, clock=SYSTEM_CLOCK, transport=f"embedded://{tmp_path / 'broker'}",
                   settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    with app.store.transaction() as tx:
        tx.execute(text("create table billed (k text)"))

    @app.handler(f"orders-{unique}", group="billing", token="key", fatal=(ValueError,))
    def bill(msg, tx) -> None:  # type: ignore[no-untyped-def]
        n = int(msg.key.removeprefix("k"))
        if n % 50 == 7:
            raise ValueError("poison")
        tx.execute(text("insert into billed (k) values (:k)"), {"k": msg.key})
        tx.publish(f"invoices-{unique}-{n % 5}", {"n": n}, key=msg.key)

    def run_round(first: int) -> None:
        for n in range(first, first + PER_ROUND):
            app.publish(f"orders-{unique}", {"n": n}, key=f"k{n}")
        for n in range(first + PER_ROUND - 20, first + PER_ROUND):  # duplicates
            app.publish(f"orders-{unique}", {"n": n}, key=f"k{n}")
        app.run(until_idle=True)
        app.relay().drain()

    run_round(0)
    labels, threads, fds = series(), threading.active_count(), len(os.listdir("/proc/self/fd"))
    for round_number in range(1, ROUNDS):
        run_round(round_number * PER_ROUND)
    stats = app.stats()
    assert stats["processed"] == ROUNDS * PER_ROUND * 49 // 50 and stats["duplicate"] == ROUNDS * 20
    assert series() == labels, f"new series: {sorted(series() - labels)[:5]}"
    values = {value for _, pairs in series() for _, value in pairs}
    assert not any(value.startswith("k") and value[1:].isdigit() for value in values), "a key in a label"
    assert threading.active_count() <= threads
    assert len(os.listdir("/proc/self/fd")) <= fds + 2
    assert structlog.contextvars.get_contextvars() == {}
    app.close()
