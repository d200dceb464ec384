"""The `Store` protocol: the durable token table, offsets, dead letters and batch fences.

A store hands out a `Transaction` that the user's handler writes through, so
the token claim, the handler's own writes, the outbox rows it publishes, the
offsets and the dead letters commit or roll back together.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.errors import ConfigurationError
from backends.types import JSON, DeadLetter, QueueRef

if TYPE_CHECKING:  # the outbox's module imports the store's primitives, which import this one
    from backends.store.outbox import SqlOutbox
    from backends.store.outbox_writer import Deferred, PublishHook


class TokenState(enum.Enum):
    """The state of a token record."""

    IN_PROGRESS = "in_progress"  # lease mode: a handler is running (until the lease expires)
    DONE = "done"


@dataclass(frozen=True)
class LeaseOutcome:
    """What `Store.lease` found: the lease is ours, or the record someone else holds."""

    acquired: bool
    state: TokenState | None = None  # of the existing record when not acquired
    result: Any = None  # the stored result of a DONE record
    expires_at: float | None = None


class Transaction(ABC):
    """One database transaction: the handler's writes and the framework's, together.

    ``connection`` is the SQLAlchemy ``Connection``; ``execute`` passes through
    to it so handlers can write ``tx.execute(text(...), {...})``.
    """

    connection: Any

    def execute(self, statement: Any, parameters: Any = None, /) -> Any:
        """Run a statement in this transaction (the handler's own writes)."""
        if parameters is None:
            return self.connection.execute(statement)
        return self.connection.execute(statement, parameters)

    @abstractmethod
    def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float = 0.0,
        content_type: str = JSON,
        message_id: str | None = None,
    ) -> str:
        """Publish a message once this transaction commits: an outbox row written in it, which a
        relay sends (rolled back with it, never sent). Returns the message id it will carry
        (``message_id``, else a new random one).

        ``body`` is encoded as `App.publish` does; a bad topic, key, header, delay, id or body
        raises `OutboxMessageError` here, before anything is written.
        """

    @abstractmethod
    def claim(self, namespace: str, tokens: Sequence[str], ttl: float) -> set[str]:
        """Insert ``tokens`` under the unique index; return the subset this call claimed.

        A token already DONE (and not expired) is not claimed: a duplicate. A
        token whose row a concurrent transaction inserted but has not yet
        committed makes this call wait for it (the unique index), then counts
        as a duplicate if that transaction committed. Expired rows are
        reclaimed.
        """

    def claim_ahead(self, namespace: str, tokens: Sequence[str], ttl: float) -> Any:
        """Send the claim of all of ``tokens`` without waiting for it, when the database can
        (a `backends.store.ahead.ClaimAhead`); None here, and wherever it cannot."""
        return None

    @abstractmethod
    def savepoint(self) -> AbstractContextManager[None]:
        """A nested transaction: an exception inside rolls back to it and propagates."""

    @abstractmethod
    def save_offsets(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        """Upsert the next offset to consume per queue for ``group``."""

    @abstractmethod
    def add_dead_letter(self, letter: DeadLetter) -> int | None:
        """Store a dead-letter record (payload bytes unchanged); its id, or None if the group
        already has a record of this message (same token, else message id) and replay count."""

    @abstractmethod
    def fence(self, name: str, batch_id: int, run_id: str) -> bool:
        """Record batch ``batch_id`` of ``name``; False if it was already recorded (a replay).

        Raises `FenceConflictError` when ``name`` was recorded by another
        ``run_id`` and ``batch_id`` is not beyond what that run recorded.
        """


class Store(ABC):
    """Durable state; every write that must be atomic with a handler goes through a transaction."""

    outbox: SqlOutbox
    """The outbox the store's transactions publish into (see `backends.store.outbox`)."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[Transaction]:
        """Begin; commit on normal exit, roll back on an exception (and re-raise it)."""

    @abstractmethod
    def hook_publish(self, hook: PublishHook) -> None:
        """Run ``hook`` around every ``tx.publish`` of this store's transactions (sync and async)."""

    @abstractmethod
    def known(self, namespace: str, tokens: Sequence[str]) -> set[str]:
        """The subset of ``tokens`` recorded DONE and not expired, in one query."""

    @abstractmethod
    def forget(self, namespace: str, tokens: Sequence[str]) -> int:
        """Delete token records (a replay of a processed message); return how many."""

    @abstractmethod
    def load_offsets(self, group: str) -> dict[QueueRef, int]:
        """The offsets saved for ``group``."""

    @abstractmethod
    def dead_letters(self, group: str, limit: int = 100, after_id: int = 0,
                     body_limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``group`` with id > ``after_id``, oldest first. With ``body_limit``, each
        body is cut to its first ``body_limit`` bytes by the database (a listing: a page of 100 MiB
        bodies is not read whole into memory) and `DeadLetter.body_size` says how large it is."""

    @abstractmethod
    def get_dead_letter(self, letter_id: int) -> DeadLetter | None:
        """One dead letter by id."""

    @abstractmethod
    def delete_dead_letters(self, ids: Sequence[int]) -> int:
        """Delete dead letters by id, except those a replay holds (`take_dead_letters`): it is
        sending them; return how many."""

    @abstractmethod
    def dead_letter_ids(self, group: str, ids: Sequence[int] | None = None, *, min_replays: int = 0) -> list[int]:
        """The ids of ``group``'s dead letters (of ``ids`` only, when given) replayed at least
        ``min_replays`` times, in order."""

    @abstractmethod
    def take_dead_letters(self, group: str, ids: Sequence[int], hold: float) -> list[DeadLetter]:
        """Those of ``ids`` that are ``group``'s dead letters and no replay holds, held for ``hold``
        seconds (in a short write transaction of their own: a replay sends them outside it):
        another replay skips them and a purge leaves them until `settle_dead_letters`, or until
        the hold runs out (the replay died)."""

    @abstractmethod
    def settle_dead_letters(self, sent: Sequence[int], unsent: Sequence[int]) -> int:
        """After a replay sent what it took: delete ``sent``, let go of ``unsent`` (they stay as
        they were); return how many were deleted."""

    @abstractmethod
    def count_dead_letters(self, group: str) -> int:
        """How many dead letters ``group`` has."""

    @abstractmethod
    def dead_letter_groups(self) -> list[str]:
        """The groups that have dead letters."""

    @abstractmethod
    def lease(self, namespace: str, token: str, lease_seconds: float) -> LeaseOutcome:
        """In its own committed transaction: take an IN_PROGRESS lease on ``token``.

        Acquired when no record exists, or the record is an expired lease (a
        crashed holder) or an expired DONE record.
        """

    @abstractmethod
    def complete_lease(self, namespace: str, token: str, result: Any, ttl: float,
                       publish: Deferred | None = None) -> None:
        """Mark a leased token DONE with its JSON-serialisable ``result``, writing the messages the
        handler published (``publish``) in the same transaction."""

    @abstractmethod
    def renew_lease(self, namespace: str, token: str, lease_seconds: float) -> bool:
        """Extend an IN_PROGRESS lease to ``now + lease_seconds``; False if there is none to extend."""

    @abstractmethod
    def release_lease(self, namespace: str, token: str) -> None:
        """Drop an IN_PROGRESS lease after a failure, so a redelivery may take it."""

    @abstractmethod
    def purge_expired(self) -> int:
        """Delete expired token records; return how many."""

    def open_async(self, connections: int) -> Any:
        """Async transactions on this store for one event loop (an `AsyncSqlStore`), for
        ``async def`` handlers; a store without an asyncio driver says so."""
        raise ConfigurationError(f"{type(self).__name__} has no async transactions; async def handlers need a SQL store")

    def ping(self) -> None:
        """One read, so a probe knows the store answers; `StoreUnavailableError` when it does not."""
        self.known("%ping", ["%ping"])

    @abstractmethod
    def ping_write(self) -> None:
        """One small write, committed (a row of the store's own, replaced each time), so a probe
        knows the store takes writes: a database whose disk is full still answers reads (`ping`).
        `StoreUnavailableError` when the store cannot be reached or refuses the write."""

    def write_refusal(self) -> str | None:
        """Why the store's disk refuses writes right now (a full disk: the database's error), or
        None; readiness reports it (`reliable.health`). A store that cannot tell says None."""
        return None

    def iter_dead_letters(self, group: str, page: int = 500) -> Iterator[DeadLetter]:
        """Every dead letter of ``group``, paged."""
        after = 0
        while batch := self.dead_letters(group, limit=page, after_id=after):
            yield from batch
            after = batch[-1].id or after

    def close(self) -> None:
        """Release connections."""
