"""``sink="store"``: the tokens are read and claimed beside the function, betting on new rows.

When every effect of the batch function goes through ``tx``, a call can be
rolled back without a trace. The wrapper then need not hold the function back
until the claim has answered: it calls it at once with the batch's rows
(those with a token), while a helper thread reads the tokens (a Spark job of
its own) and claims them in the same transaction. The function's first use
of ``tx`` waits for the claim, so the connection is never used by two threads
at once; everything the function does before that (reading the rows from
Spark, building its statements) overlaps the token read and the database's
insert of the token rows.

The bet is that the batch holds only new tokens, each once. When it does
not (a token already recorded, a token twice, or a batch that must be
cached), the helper raises `LostBet`: the transaction rolls back, and the
batch is run again in order (claim first, then the function with the known
rows dropped). The wrapper stops betting after a lost bet, until a batch is
all new again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pyspark import InheritableThread

T = TypeVar("T")


class LostBet(Exception):
    """Raised when a batch run beside its claim turned out not to be all new: run it in order."""


class Helper(Generic[T]):
    """``work`` on a thread that carries the micro-batch's Spark local properties."""

    def __init__(self, work: Callable[[], T], name: str) -> None:
        self._work = work
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = InheritableThread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._work()
        except BaseException as exc:  # handed to the caller by `result`
            self._error = exc

    def result(self) -> T:
        """Wait for the work; its value, or raise what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


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
