"""``sink="store"``: the tokens are claimed beside the function, betting that they are all new.

When every effect of the batch function goes through ``tx``, a call can be
rolled back without a trace. The wrapper then need not hold the function back
until the claim has answered: once the tokens are read, it calls the function
with the rows of every token the cache does not know while a helper thread
claims those tokens in the same transaction. The function's first use of ``tx`` waits for the claim, so the
connection is never used by two threads at once; what the function does
before that (reading the rows from Spark, building its statements) overlaps
the database's insert of the token rows.

The bet is that the store knows none of the tokens the cache does not know
(copies within the batch and tokens the cache knows are dropped before the
call, as in order). It is lost when the claim finds one already recorded (by
an earlier batch the cache has not heard of, or a concurrent writer): the
helper raises `LostBet`, the transaction rolls back, and the batch runs again
in order (claim first, then the function without the recorded rows). After a
lost bet the wrapper runs batches in order until the store again knows none
of the tokens it is asked to claim, so a stream of replays does not pay for
calls that roll back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LostBet(Exception):
    """Raised when a batch run beside its claim turned out not to be all new: run it in order."""


class Helper(Generic[T]):
    """``work`` on a thread of its own (store work only: it runs no Spark job)."""

    def __init__(self, work: Callable[[], T], name: str) -> None:
        self._work = work
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._work()
        except BaseException as exc:  # handed to the caller by `result`
            self._error = exc

    def wait(self) -> None:
        """Wait for the work to end, however it ends."""
        self._thread.join()

    def result(self) -> T:
        """Wait for the work; its value, or raise what it raised."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def call_beside(call: Callable[[Any], object], tx: Any, claim: Callable[[], T], name: str) -> T:
    """``call(tx)`` while ``claim()`` runs on a helper thread; the claim's result.

    ``call`` gets ``tx`` behind `AfterClaim`; the claim's failure (a lost bet
    included) wins over the call's, even when the call swallowed it.
    """
    helper = Helper(claim, name)
    try:
        call(AfterClaim(tx, helper))
    except Exception:
        helper.result()  # a lost bet or a failed claim is why the call failed
        raise
    except BaseException:  # an interrupt stays one, once the helper is off the connection
        helper.wait()
        raise
    return helper.result()


class AfterClaim:
    """The batch transaction as the function sees it: any use waits for the claim beside it.

    A lost bet stops the function there with `LostBet` (the call is rolled
    back and made again in order).
    """

    def __init__(self, tx: Any, claim: Helper[Any]) -> None:
        self._tx = tx
        self._claim = claim

    def __getattr__(self, name: str) -> Any:
        self._claim.result()
        return getattr(self._tx, name)
