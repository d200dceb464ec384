"""The ways a batch of tokens is claimed under the unique index, behind one interface.

A `ClaimPath` claims a `Claim` (distinct tokens in lock order) and returns
the tokens it inserted or reclaimed from expired rows, or None when it cannot
decide that batch, so that ``a | b`` falls back to ``b``. Each dialect
chains its paths (`Dialect.claim_paths`): the one-row ``INSERT`` of the
per-message pipeline, the batch statement of the dialect, and on PostgreSQL
a ``COPY`` tried first for large batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Double, String, bindparam, null

from backends.store.base import TokenState
from backends.store.schema import tokens

DONE = TokenState.DONE.value
IN_PROGRESS = TokenState.IN_PROGRESS.value


@dataclass(frozen=True)
class Claim:
    """What to claim: ``batch`` (distinct, in lock order) of ``namespace`` in ``state``."""

    namespace: str
    batch: Sequence[str]
    now: float
    expires_at: float
    state: str = DONE

    @property
    def parameters(self) -> dict[str, Any]:
        """The bound parameters every claim statement shares."""
        return {"namespace": self.namespace, "state": self.state, "now": self.now,
                "expires_at": self.expires_at}


class ClaimPath(ABC):
    """One way to claim a batch; ``a | b`` tries ``b`` where ``a`` cannot decide."""

    @abstractmethod
    def __call__(self, connection: Connection, claim: Claim) -> set[str] | None:
        """The tokens claimed, or None when this way cannot decide ``claim``."""

    def __or__(self, other: ClaimPath) -> ClaimPath:
        return _Either(self, other)


class _Either(ClaimPath):
    def __init__(self, first: ClaimPath, second: ClaimPath) -> None:
        self.first, self.second = first, second

    def __call__(self, connection: Connection, claim: Claim) -> set[str] | None:
        claimed = self.first(connection, claim)
        return self.second(connection, claim) if claimed is None else claimed


def on_conflict_reclaim(insert: Any) -> Any:
    """Overwrite an existing row only when it has expired; return the tokens written.

    A live row (committed, or being inserted by a concurrent twin, which makes
    the statement wait) is left alone and not returned.
    """
    excluded = insert.excluded
    return insert.on_conflict_do_update(
        index_elements=[tokens.c.namespace, tokens.c.token],
        set_={
            "state": excluded.state,
            "result": excluded.result,
            "created_at": excluded.created_at,
            "expires_at": excluded.expires_at,
        },
        # excluded.created_at is "now": no extra parameter, so one cached statement serves all
        where=tokens.c.expires_at < excluded.created_at,
    ).returning(tokens.c.token)


CLAIM_COLUMNS = ["namespace", "token", "state", "result", "created_at", "expires_at"]
"""The columns a claim writes, in the order of `claimed_row`."""


def claimed_row(token: Any) -> list[Any]:
    """The values of one claimed row, ``token`` given (a parameter, or a column of a set)."""
    return [
        bindparam("namespace", type_=String),
        token,
        bindparam("state", type_=String),
        null(),
        bindparam("now", type_=Double),
        bindparam("expires_at", type_=Double),
    ]


class OneRow(ClaimPath):
    """A batch of one (the per-message pipeline, a lease): a plain one-row ``INSERT``."""

    def __init__(self, insert: Callable[[Any], Any]) -> None:
        row = dict(zip(CLAIM_COLUMNS, claimed_row(bindparam("token", type_=String)), strict=True))
        self._statement = on_conflict_reclaim(insert(tokens).values(**row))

    def __call__(self, connection: Connection, claim: Claim) -> set[str] | None:
        if len(claim.batch) != 1:
            return None
        parameters = {**claim.parameters, "token": claim.batch[0]}
        return set(connection.execute(self._statement, parameters).scalars())
