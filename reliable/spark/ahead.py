"""``sink="store"``: the tokens are claimed ahead of the function, betting that they are new.

When every effect of the batch function goes through ``tx``, a call can be
rolled back without a trace. The wrapper then need not hold the function back
until the claim has answered: it sends the claim of the batch's tokens into a
pipeline (PostgreSQL, `backends.store.ahead`) and calls the function at once.
PostgreSQL inserts the token rows while the function reads the batch from
Spark, and the function's bulk writes (``insert_rows``' ``executemany``) join
the same pipeline behind the claim instead of waiting for it. Any other use of
``tx`` waits until the pipeline has ended and the claim has answered.

The bet is that the store knows none of the tokens the cache does not know
(copies within the batch and tokens the cache knows are dropped before the
call, as in order). It is lost when the claim finds one already recorded (by
an earlier batch the cache has not heard of, or a concurrent writer): the
function's next use of ``tx`` raises `LostBet`, the transaction rolls back
(even if the function swallowed the error), and the batch runs again in order
(claim first, then the function without the recorded rows). After a lost bet
the wrapper runs batches in order until the store again knows none of the
tokens it is asked to claim, so a stream of replays does not pay for calls
that roll back (the `claim.Betting` strategy keeps that state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.store.ahead import ClaimAhead, rides_pipeline


class LostBet(Exception):
    """Raised when a batch called ahead of its claim was not all new: run it in order."""


def call_ahead_of_claim(call: Callable[[Any], object], tx: Any, claim: ClaimAhead) -> set[str]:
    """``call(tx)`` with ``claim`` sent ahead; the tokens claimed, or `LostBet`.

    ``call`` gets ``tx`` behind `ClaimFirst`. A claim that did not go through
    wins over the call's own failure, even when the call swallowed it.
    """
    try:
        call(ClaimFirst(tx, claim))
    except Exception as exc:
        if claim.settle(quiet=True) is None:  # the call failed because the claim did
            raise LostBet("a token already has a row") from exc
        raise
    except BaseException:  # an interrupt stays one, once the pipeline has ended
        claim.settle(quiet=True)
        raise
    return _claimed(claim)


def _claimed(claim: ClaimAhead) -> set[str]:
    """End the pipeline: the tokens claimed, or `LostBet` if the claim did not go through."""
    claimed = claim.settle()
    if claimed is None:
        raise LostBet("a token already has a row")
    return claimed


class ClaimFirst:
    """The batch transaction as the function sees it: bulk writes ride the claim's pipeline,
    any other use waits for the claim to answer (`LostBet` if it did not go through)."""

    def __init__(self, tx: Any, claim: ClaimAhead) -> None:
        self._tx = tx
        self._claim = claim

    def execute(self, statement: Any, parameters: Any = None, /) -> Any:
        if not (self._claim.open and rides_pipeline(statement, parameters)):
            self._settled()
        return self._tx.execute(statement, parameters)

    def __getattr__(self, name: str) -> Any:
        self._settled()
        return getattr(self._tx, name)

    def _settled(self) -> None:
        _claimed(self._claim)
