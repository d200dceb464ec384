"""The small store the derived-file damage tests copy and damage, and what they read back with."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from storetools import record_for, small_config

from broker.store import AppendResult, MessageStore

COUNT = 120
QUEUES = 3


Built = tuple[Path, list[AppendResult]]
"""A small store's folder and where its records were placed."""


def build(path: Path) -> Built:
    """A store of 120 records over three queues: several segments, queue files and index files."""
    with MessageStore(path, small_config()) as store:
        placed = store.append([record_for(f"m{i}", "orders", i % QUEUES) for i in range(COUNT)])
    return path, placed


def fresh_copy(base: Path, work: Path) -> Path:
    """``work``: a copy of the store in ``base``, to damage."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    return work


def flip(path: Path, position: int, bit: int) -> None:
    """Flip one bit of ``path``."""
    with open(path, "r+b") as damaged:
        damaged.seek(position)
        byte = damaged.read(1)[0]
        damaged.seek(position)
        damaged.write(bytes([byte ^ (1 << bit)]))


def read_queue(store: MessageStore, queue: int) -> Iterator[object]:
    """Every message of orders/<queue> the store returns, in small reads."""
    offset = 0
    while batch := store.read("orders", queue, offset, 7):
        yield from batch
        offset = batch[-1].queue_offset + 1


def assert_queue_whole(store: MessageStore, placed: list[AppendResult], queue: int) -> None:
    """orders/<queue> holds every message placed there, unchanged, and takes the next one after them."""
    assert [(m.message_id, m.body) for m in read_queue(store, queue)] == [  # type: ignore[attr-defined]
        (p.message_id, record_for(p.message_id).body) for p in placed if p.queue == queue]
    assert store.max_offset("orders", queue) == sum(1 for p in placed if p.queue == queue)
    [added] = store.append([record_for("new", "orders", queue)])
    assert store.read("orders", queue, added.queue_offset - 1, 2)[-1].message_id == "new"


def grow(path: Path) -> None:
    """Append junk to ``path``."""
    with open(path, "ab") as damaged:
        damaged.write(b"junk")
