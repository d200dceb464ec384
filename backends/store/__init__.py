"""Stores: the durable token table, offsets, dead letters and batch fences.

``open_store(url)`` picks the backend from the URL: ``sqlite:///path`` (the
embedded default) or ``postgresql+psycopg://...`` (plain ``postgresql://`` is
mapped to psycopg 3).
"""

from __future__ import annotations

from backends.clock import SYSTEM_CLOCK, Clock
from backends.store.base import LeaseOutcome, Store, TokenState, Transaction
from backends.store.engine import ALLOWED_SCHEMES
from backends.store.sqlalchemy import SqlStore, SqlTransaction

__all__ = [
    "ALLOWED_SCHEMES",
    "LeaseOutcome",
    "SqlStore",
    "SqlTransaction",
    "Store",
    "TokenState",
    "Transaction",
    "open_store",
]


def open_store(url: str, clock: Clock = SYSTEM_CLOCK, *, outbox: str = "default") -> Store:
    """The store for ``url``, publishing into the outbox named ``outbox``; an unknown scheme
    raises `UnsupportedURLError`.

    Nothing is connected yet: the tables are created on first use, and an
    unreachable database raises `StoreUnavailableError` then.
    """
    return SqlStore(url, clock, outbox=outbox)
