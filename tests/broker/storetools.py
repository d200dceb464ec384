"""Helpers shared by the store tests: small configs, deterministic bodies, reading everything."""

from __future__ import annotations

import hashlib
from pathlib import Path

from broker.store import FakeClock, MessageStore, Record, StoreConfig, StoredMessage


def small_config(**overrides: object) -> StoreConfig:
    """A config with tiny files, so a few records roll segments, queue and index files."""
    settings: dict[str, object] = {
        "flush": "none", "segment_size": 16 * 1024, "max_record_size": 8 * 1024,
        "queue_file_entries": 16, "index_slots": 16, "index_entries": 64,
        "checkpoint_interval": 0, "clock": FakeClock(),
    }
    settings.update(overrides)
    return StoreConfig(**settings)  # type: ignore[arg-type]


def body_for(message_id: str, limit: int = 3000) -> bytes:
    """A deterministic body of 0..limit bytes derived from a message id."""
    digest = hashlib.sha256(message_id.encode()).digest()
    length = int.from_bytes(digest[:2], "little") % (limit + 1)
    return (digest * (length // len(digest) + 1))[:length]


def record_for(message_id: str, topic: str = "orders", queue: int = 0) -> Record:
    return Record(topic, queue, body_for(message_id), key=f"key-{message_id}",
                  headers={"id": message_id}, message_id=message_id, tag="t")


def read_all(store: MessageStore) -> list[StoredMessage]:
    """Every message of every queue, in queue order."""
    messages: list[StoredMessage] = []
    for topic, queue in store.queues():
        offset = store.min_offset(topic, queue)
        while True:
            batch = store.read(topic, queue, offset, 64)
            if not batch:
                break
            messages.extend(batch)
            offset = batch[-1].queue_offset + 1
    return messages


def segments(path: Path) -> list[Path]:
    return sorted((path / "commitlog").glob("*.log"))
