"""A writer process for the kill -9 test: appends with `sync` flush and acks each batch.

Usage: crash_writer.py STORE_DIR ACK_FILE RUN THREADS (the test forks `write` with those
arguments from `tests.forked`'s fork server instead: no interpreter start per kill)

Each thread appends batches of 1-4 records with ids ``RUN-THREAD-N`` and, only
after `append` returns, writes the batch's ids as one line to ACK_FILE (one
``write`` per line, so a kill never leaves half a line that parses).
"""

from __future__ import annotations

import os
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from storetools import record_for

from broker.store import MessageStore, StoreConfig

CONFIG = StoreConfig(flush="sync", segment_size=64 * 1024, max_record_size=8 * 1024,
                     queue_file_entries=64, index_slots=64, index_entries=256,
                     checkpoint_interval=0.05)


def produce(store: MessageStore, ack_fd: int, run: int, thread: int) -> None:
    rng = random.Random(f"{run}-{thread}")
    n = 0
    while True:
        ids = [f"{run}-{thread}-{n + i}" for i in range(rng.randint(1, 4))]
        n += len(ids)
        store.append([record_for(i, "crash", thread % 3) for i in ids])
        os.write(ack_fd, (" ".join(ids) + "\n").encode())


def write(directory: str, ack_file: str, run: int, threads: int) -> None:
    """Append and ack from ``threads`` threads until killed."""
    store = MessageStore(directory, CONFIG)
    ack_fd = os.open(ack_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    workers = [threading.Thread(target=produce, args=(store, ack_fd, run, t), daemon=True)
               for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
