"""Stores: the durable token table, offsets, dead letters and batch fences.

``open_store(url)`` picks the backend from the URL: ``sqlite:///path`` (the
embedded default) or ``postgresql+psycopg://...`` (plain ``postgresql://`` is
mapped to psycopg 3).

`SqlStore` and its modules are imported on first use (``open_store``, or the
name itself): ``reliable --help``, ``reliable settings`` and the settings'
check of a store URL (`ALLOWED_SCHEMES`) do not load every SQL dialect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backends.clock import SYSTEM_CLOCK, Clock
from backends.store.base import LeaseOutcome, Store, TokenState, Transaction
from backends.store.engine import ALLOWED_SCHEMES

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name in ("SqlStore", "SqlTransaction"):
        from backends.store import sqlalchemy

        return getattr(sqlalchemy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(url: str, clock: Clock = SYSTEM_CLOCK, *, outbox: str = "default") -> Store:
    """The store for ``url``, publishing into the outbox named ``outbox``; an unknown scheme
    raises `UnsupportedURLError`.

    Nothing is connected yet: the tables are created on first use, and an
    unreachable database raises `StoreUnavailableError` then.
    """
    from backends.store.sqlalchemy import SqlStore

    return SqlStore(url, clock, outbox=outbox)
