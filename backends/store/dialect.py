"""What differs between the databases a store runs on: a few primitives per dialect.

`SqlStore` writes every public operation once over a `Dialect`: how the
engine is built, the ``INSERT`` that knows ``ON CONFLICT``, how a read-only
unit begins, how a batch of tokens is claimed and looked up, and whether a
claim can be sent ahead. `backends.store.sqlite` and
`backends.store.postgresql` implement them; nothing else asks which
database it is on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.engine import URL

from backends.store.claims import Claim, ClaimPath


class Dialect(ABC):
    """The primitives of one database, for one store (a claim path may keep state)."""

    chunk: int
    """How many values one ``IN (...)`` list may carry (under the bound-parameter limit)."""

    def __init__(self) -> None:
        self.claim: ClaimPath = self.claim_paths()

    @abstractmethod
    def engine(self, url: URL) -> Engine:
        """An engine tuned for this database (pool, locking)."""

    @abstractmethod
    def insert(self, table: Table) -> Any:
        """The dialect's ``INSERT`` construct, which knows ``ON CONFLICT``."""

    @abstractmethod
    def read_only(self, connection: Connection) -> None:
        """Prepare ``connection``, not yet begun, for a unit of work that only reads."""

    @abstractmethod
    def claim_paths(self) -> ClaimPath:
        """The ways this database claims a batch, chained with ``|`` (the last always decides)."""

    @abstractmethod
    def known(self, connection: Connection, namespace: str, batch: Sequence[str], now: float) -> set[str]:
        """The tokens of ``batch`` recorded DONE and not expired at ``now``, in one query."""

    def claim_ahead(self, connection: Connection, claim: Claim) -> Any:
        """Send ``claim`` without waiting for it (a `backends.store.ahead.ClaimAhead`), or None
        where the database cannot."""
        return None
