"""How a micro-batch's tokens are claimed around the batch function: the claim strategies.

A strategy is one call with one signature (`ClaimStrategy`): given the batch
transaction, the tokens the cache does not know and the batch function, it
claims the tokens and calls the function with the rows of those it got, and
says what it did (`Claimed`). The wrapper holds one strategy for its stream
and never asks how it claims:

* `InOrder` (the default): claim first, then call the function with the
  claimed rows only;
* `Betting` (``sink="store"``): send the claim ahead of the function while
  the store knew none of the tokens it was last asked to claim (see `ahead`);
  a lost bet raises `LostBet` after the strategy switched itself to claiming
  in order, so the wrapper simply runs the transaction again.

The betting state belongs to the `Betting` object, the one component that
reads and changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.clock import Clock
from reliable.idempotency import Guard
from reliable.spark.ahead import LostBet, call_ahead_of_claim

BatchCall = Callable[[Any, set[str]], object]
"""The batch function as a strategy calls it: the transaction it writes through, the tokens
whose rows it gets."""


@dataclass(frozen=True)
class Claimed:
    """What a claim strategy did: the tokens claimed, whether the claim went ahead of the
    function, and how long the claim and the function took (seconds, on the app's clock)."""

    tokens: set[str]
    ahead: bool = False
    seconds: dict[str, float] = field(default_factory=dict)


class ClaimStrategy(Protocol):
    def __call__(self, tx: Any, tokens: list[str], call: BatchCall) -> Claimed: ...


@dataclass(frozen=True)
class InOrder:
    """Claim the tokens, then call the function with the rows of those claimed."""

    guard: Guard
    clock: Clock

    def __call__(self, tx: Any, tokens: list[str], call: BatchCall) -> Claimed:
        started = self.clock.monotonic()
        claimed = self.guard.claim(tx, tokens)
        claimed_at = self.clock.monotonic()
        call(tx, claimed)
        return Claimed(claimed, False, {"claim": claimed_at - started, "function": self.clock.monotonic() - claimed_at})


class Betting:
    """Send the claim ahead of the function, betting the tokens are new (see `ahead`).

    Betting stops when a bet is lost and starts again once a batch claimed in
    order finds the store knew none of the tokens it was asked to claim. Where
    the store cannot send a claim ahead, every batch is claimed in order.
    """

    def __init__(self, guard: Guard, clock: Clock) -> None:
        self.guard = guard
        self.clock = clock
        self.in_order = InOrder(guard, clock)
        self._betting = True

    def __call__(self, tx: Any, tokens: list[str], call: BatchCall) -> Claimed:
        claim = tx.claim_ahead(self.guard.namespace, tokens, self.guard.token_ttl) if self._betting else None
        if claim is None:
            done = self.in_order(tx, tokens, call)
            self._betting = len(done.tokens) == len(tokens)
            return done
        started = self.clock.monotonic()
        try:
            claimed = call_ahead_of_claim(lambda claim_first: call(claim_first, set(tokens)), tx, claim)
        except LostBet:
            self._betting = False  # the wrapper runs the transaction again: in order
            raise
        return Claimed(claimed, True, {"function": self.clock.monotonic() - started})  # with the claim


def claim_strategy(sink: str, guard: Guard, clock: Clock) -> ClaimStrategy:
    """The strategy for a wrapper's ``sink`` option."""
    return Betting(guard, clock) if sink == "store" else InOrder(guard, clock)
