"""Whether the store's disk is refusing writes right now, for readiness (`reliable.health`).

A full disk is an outage the worker rides out by deferring every message it
cannot write, so the worker stays alive and reachable; only the transaction
that fails says the disk is full. The store tells its `WriteRefusals` how
each transaction ended: one that failed for a full disk sets the refusal
(with the database's words), one that wrote and committed clears it. Reads,
and transactions that wrote nothing (a relay finding no outbox rows, a
duplicate's claim), do neither: a database on a full disk still answers them.
Whether a transaction wrote is asked of the database (`Dialect.written`) only
while writes are refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import structlog
from sqlalchemy.exc import DBAPIError

from backends.store.engine import is_disk_full, is_unavailable

log = structlog.get_logger(__name__)


def database_errors(exc: BaseException | None) -> Iterator[DBAPIError]:
    """The database errors in ``exc``'s chain (a `StoreUnavailableError` wraps one)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DBAPIError):
            yield exc
        exc = exc.__cause__ or exc.__context__


class WriteRefusals:
    """The last write refusal of a full disk, until a transaction commits again.

    ``full_disk`` names the directory of the database's files when their disk
    has no room (SQLite may call a full disk only "disk I/O error"), or None.
    """

    def __init__(self, store: str, full_disk: Callable[[], str | None]) -> None:
        self._store = store
        self._full_disk = full_disk
        self._lock = threading.Lock()
        self._refusal: str | None = None

    @property
    def refusal(self) -> str | None:
        """Why writes are refused (the database's error), or None once a write committed."""
        return self._refusal

    def failed(self, exc: BaseException) -> None:
        """A transaction failed with ``exc``: a refusal when a database error in it means a full disk."""
        for error in database_errors(exc):
            if is_disk_full(error) or (is_unavailable(error) and self._full_disk() is not None):
                self._set(str(error.orig).strip())
                return

    def committed(self) -> None:
        """A transaction that wrote committed: the disk takes writes again."""
        if self._refusal is not None:
            self._set(None)

    def _set(self, refusal: str | None) -> None:
        with self._lock:
            before, self._refusal = self._refusal, refusal
        if before is None and refusal is not None:
            log.warning("store.writes_refused", store=self._store, error=refusal)
        elif before is not None and refusal is None:
            log.info("store.writes_accepted", store=self._store, refused=before)
