"""The SQLite file behind `embedded://`: its schema, and connections safe across threads and processes.

One connection per thread and process (a forked child opens its own). WAL
journal with ``synchronous=FULL``: a committed publish, fetch or ack survives
a crash of the process or the machine. ``NORMAL`` (an option) still survives
a killed process but may lose the last commits on power loss; it is faster. Every write is one ``BEGIN IMMEDIATE``
transaction, so writers in several processes are serialized by SQLite's lock
(waiting up to ``busy_timeout``) and a fetch claims its messages atomically.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backends.errors import ConfigurationError, TransportError

DATABASE_FILE = "queue.db"
SYNCHRONOUS = ("FULL", "NORMAL")

# deliveries.due_at: when the row is fetchable again; the lease end of an
# in_flight row, the redelivery time of a scheduled one. A row exists only
# while a message is outstanding for its group: acks delete it.
SCHEMA = """
CREATE TABLE IF NOT EXISTS queues (
    topic TEXT NOT NULL, queue INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY (topic, queue)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS messages (
    topic TEXT NOT NULL, queue INTEGER NOT NULL, "offset" INTEGER NOT NULL,
    id TEXT NOT NULL, key TEXT, headers TEXT NOT NULL, payload BLOB NOT NULL,
    published_at REAL NOT NULL,
    PRIMARY KEY (topic, queue, "offset")
);
CREATE TABLE IF NOT EXISTS delayed (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, queue INTEGER NOT NULL,
    id TEXT NOT NULL, key TEXT, headers TEXT NOT NULL, payload BLOB NOT NULL,
    published_at REAL NOT NULL, due_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS delayed_due ON delayed (topic, due_at);
CREATE TABLE IF NOT EXISTS cursors (
    grp TEXT NOT NULL, topic TEXT NOT NULL, queue INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY (grp, topic, queue)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS deliveries (
    grp TEXT NOT NULL, topic TEXT NOT NULL, queue INTEGER NOT NULL, "offset" INTEGER NOT NULL,
    state TEXT NOT NULL, attempt INTEGER NOT NULL, first_failure_at REAL, headers TEXT,
    due_at REAL NOT NULL,
    PRIMARY KEY (grp, topic, queue, "offset")
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries (grp, topic, due_at);
CREATE TABLE IF NOT EXISTS dead_letters (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, grp TEXT NOT NULL, topic TEXT NOT NULL,
    queue INTEGER NOT NULL, "offset" INTEGER NOT NULL, id TEXT NOT NULL, key TEXT,
    headers TEXT NOT NULL, payload BLOB NOT NULL, attempt INTEGER NOT NULL,
    published_at REAL NOT NULL, first_failure_at REAL, failure TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_group ON dead_letters (grp, seq);
"""


class Database:
    """The queue database at ``directory/queue.db``; created on first use."""

    def __init__(
        self, directory: str | Path, busy_timeout: float, synchronous: str = "FULL"
    ) -> None:
        if synchronous not in SYNCHRONOUS:
            raise ConfigurationError(
                f"transport option synchronous={synchronous!r}: allowed are {', '.join(SYNCHRONOUS)}"
            )
        self.path = Path(directory).expanduser() / DATABASE_FILE
        self._busy_timeout = busy_timeout
        self._synchronous = synchronous
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._writers: dict[int, threading.Lock] = {}  # per process: a fork gets a fresh one
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.write() as connection:
                for statement in SCHEMA.split(";"):
                    connection.execute(statement)
        except OSError as exc:
            raise TransportError(
                f"cannot create the embedded broker at {self.path}: {exc}"
            ) from exc

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (a new one after a fork)."""
        connection = getattr(self._local, "connection", None)
        if connection is None or self._local.pid != os.getpid():
            connection = self._connect()
            self._local.connection, self._local.pid = connection, os.getpid()
        return connection

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A ``BEGIN IMMEDIATE`` transaction: committed on exit, rolled back on error.

        Threads of one process queue on a mutex first, so only writers in
        other processes meet SQLite's (sleeping) busy handler.
        """
        with self._writers.setdefault(os.getpid(), threading.Lock()):
            connection = self.connection()
            try:
                connection.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise TransportError(
                    f"embedded broker {self.path}: cannot begin a write: {exc}"
                ) from exc
            try:
                yield connection
            except sqlite3.Error as exc:
                connection.execute("ROLLBACK")
                raise TransportError(f"embedded broker {self.path}: {exc}") from exc
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            try:
                connection.execute("COMMIT")
            except sqlite3.Error as exc:
                connection.execute("ROLLBACK")
                raise TransportError(f"embedded broker {self.path}: commit failed: {exc}") from exc

    def read(self, sql: str, parameters: tuple = ()) -> list[tuple]:
        """Rows of one query, outside any write transaction."""
        try:
            return self.connection().execute(sql, parameters).fetchall()
        except sqlite3.Error as exc:
            raise TransportError(f"embedded broker {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for connection in opened:
            connection.close()
        self._local = threading.local()

    def _connect(self) -> sqlite3.Connection:
        try:
            connection = sqlite3.connect(
                self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
            )
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={self._synchronous}")
            connection.execute(f"PRAGMA busy_timeout={int(self._busy_timeout * 1000)}")
        except sqlite3.Error as exc:
            raise TransportError(f"cannot open the embedded broker at {self.path}: {exc}") from exc
        with self._lock:
            self._opened.append(connection)
        return connection
