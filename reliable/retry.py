"""Retry, built once on tenacity: in process, with a redelivery policy's backoff, and reconnects.

A failing message is first retried in process (`call_with_retry`: a few
quick attempts), then handed back to the transport with the delay its
redelivery policy computes (`reliable.redelivery`). Work retried where it
runs uses the policy itself as tenacity's wait (`call_with_redelivery`: a
Spark micro-batch), and a worker that lost its transport waits a `Backoff`.

Every one of them is a `RetryPlan`: tenacity's stop, wait and retry
strategies, run by `Retrying` on the injected clock's sleep, or by
`AsyncRetrying` on an awaited sleep (`backends.clock.pause` on that clock)
for coroutines, from the same objects. A loop that retries on its own waits a
`Backoff` (defined in `backends.backoff`, where the backends' own reconnects
use it too). Which exceptions are worth retrying at all is decided in
`reliable.classify` (re-exported here, as are `Backoff`, the durations of
`reliable.durations` and the policies of `reliable.redelivery`).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base, wait_none

from backends.backoff import Backoff
from backends.clock import Clock
from backends.errors import BackendRefusedError
from reliable.classify import (
    POISON,
    Classifier,
    Rule,
    Verdict,
    build_classifier,
    classify,
    fatal_on,
    retry_on,
    when,
)
from reliable.durations import DURATION_HELP, parse_duration
from reliable.redelivery import (
    NO_LIMIT,
    ROCKETMQ_DELAY_LEVELS,
    UNLIMITED,
    Check,
    DelayLevels,
    Redelivery,
    RedeliveryPolicy,
    RedeliveryWait,
    count,
    number,
    validate,
)

__all__ = [
    "DURATION_HELP",
    "NO_LIMIT",
    "POISON",
    "ROCKETMQ_DELAY_LEVELS",
    "UNLIMITED",
    "Backoff",
    "Check",
    "Classifier",
    "DelayLevels",
    "InProcessRetry",
    "Redelivery",
    "RedeliveryPolicy",
    "RetriesSpent",
    "RetryPlan",
    "Rule",
    "Verdict",
    "build_classifier",
    "call_with_redelivery",
    "call_with_retry",
    "call_with_retry_async",
    "classify",
    "fatal_on",
    "parse_duration",
    "retry_on",
    "when",
]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPlan:
    """tenacity's stop, wait and retry strategies, run the same way for functions and coroutines.

    The last exception propagates unchanged (``reraise``); a `BaseException`
    that is not an `Exception` is never retried (tenacity's retry predicates
    see it, ours refuse it).
    """

    stop: stop_base
    wait: wait_base | Callable[[RetryCallState], float]
    retry: retry_base
    before_sleep: Callable[[RetryCallState], None] | None = None

    def call(self, fn: Callable[[], T], clock: Clock) -> T:
        """``fn()`` until it succeeds or the plan stops, sleeping on ``clock``."""
        retrying = Retrying(stop=self.stop, wait=self.wait, retry=self.retry,
                            before_sleep=self.before_sleep, sleep=clock.sleep, reraise=True)
        return retrying(fn)

    async def call_async(self, fn: Callable[[], Awaitable[T]], sleep: Callable[[float], Awaitable[None]]) -> T:
        """``await fn()`` until it succeeds or the plan stops, awaiting ``sleep`` between calls
        (`backends.clock.pause` on the runtime's clock: the event loop never blocks).

        ``fn`` may be any callable returning an awaitable (a lambda): each call is
        awaited here, as tenacity awaits only what a coroutine function returns.
        """

        async def attempt() -> T:
            return await fn()

        retrying = AsyncRetrying(stop=self.stop, wait=self.wait, retry=self.retry,
                                 before_sleep=self.before_sleep, sleep=sleep, reraise=True)
        result: T = await retrying(attempt)
        return result


def retry_when(classifier: Classifier | None, *, unless: tuple[type[BaseException], ...] = ()) -> retry_base:
    """tenacity's retry strategy for ``classifier``: an `Exception` it gives `Verdict.RETRY`."""

    def retryable(exc: BaseException) -> bool:
        return (isinstance(exc, Exception) and not isinstance(exc, unless)
                and classify(exc, classifier) is Verdict.RETRY)

    return retry_if_exception(retryable)


def _exception(state: RetryCallState) -> BaseException:
    """The exception of the attempt that just failed (tenacity calls before_sleep only then)."""
    exc = state.outcome.exception() if state.outcome is not None else None
    assert exc is not None
    return exc


# -- in-process retry ---------------------------------------------------------


@dataclass(frozen=True)
class InProcessRetry(wait_base):
    """A few quick retries inside the worker before the message goes back to the broker.

    ``attempts`` counts calls (1: no retry); the wait after call n is
    ``initial_wait * multiplier ** (n - 1)``, at most ``max_wait``. It is
    tenacity's wait (so it combines with ``+``); ``stop`` is its stop.
    """

    attempts: int = 3
    initial_wait: float = 0.05
    max_wait: float = 1.0
    multiplier: float = 2.0
    _exponential: wait_exponential = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self, {
            "attempts": count(1, "an integer >= 1"),
            "initial_wait": number(lambda v: v >= 0, "seconds >= 0"),
            "max_wait": number(lambda v: v >= 0, "seconds >= 0"),
            "multiplier": number(lambda v: v >= 1, "a number >= 1"),
        })
        object.__setattr__(self, "_exponential", wait_exponential(
            multiplier=self.initial_wait, exp_base=self.multiplier, max=self.max_wait))

    def __call__(self, retry_state: RetryCallState) -> float:
        return float(self._exponential(retry_state))

    @property
    def stop(self) -> stop_base:
        return stop_after_attempt(self.attempts)


def _in_process_plan(policy: InProcessRetry, classifier: Classifier | None,
                     on_retry: Callable[[BaseException, int], Any] | None) -> RetryPlan:
    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            on_retry(_exception(state), state.attempt_number)

    return RetryPlan(stop=policy.stop, wait=policy, retry=retry_when(classifier, unless=(BackendRefusedError,)),
                     before_sleep=before_sleep)


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: InProcessRetry,
    classifier: Classifier | None = None,
    clock: Clock,
    on_retry: Callable[[BaseException, int], Any] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, fails FATAL, or ``policy.attempts`` calls are spent.

    Waits go through ``clock.sleep``. The last exception propagates unchanged;
    a FATAL one, or a `BaseException` that is not an `Exception`, at once.
    ``on_retry(exc, attempt)`` runs before each wait, with the failed call's number.
    """
    return _in_process_plan(policy, classifier, on_retry).call(fn, clock)


async def call_with_retry_async(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: InProcessRetry,
    classifier: Classifier | None = None,
    sleep: Callable[[float], Awaitable[None]],
    on_retry: Callable[[BaseException, int], Any] | None = None,
) -> T:
    """`call_with_retry` for a coroutine function: the same plan, awaiting ``sleep`` between calls."""
    return await _in_process_plan(policy, classifier, on_retry).call_async(fn, sleep)


# -- retried where it runs, with a redelivery policy ----------------------------


class RetriesSpent(Exception):
    """Raised by `call_with_redelivery` when a call failed FATAL or its policy gave up."""

    def __init__(self, error: Exception, attempts: int) -> None:
        super().__init__(f"{type(error).__name__} after {attempts} attempt(s): {error}")
        self.error = error
        self.attempts = attempts


def call_with_redelivery(
    fn: Callable[[int], T],
    *,
    policy: RedeliveryWait | None,
    classifier: Classifier | None,
    clock: Clock,
    rng: Any = None,
    propagate: tuple[type[Exception], ...] = (),
    on_retry: Callable[[Exception, int, float], Any] | None = None,
) -> T:
    """``fn(attempt)`` until it succeeds, waiting the policy's growing delays between failures.

    For work that is retried where it runs, with a redelivery policy's backoff
    (a Spark micro-batch: there is no transport to redeliver it). A FATAL
    failure, or one after which ``policy`` gives up (no policy: at once), raises
    `RetriesSpent` from it; ``propagate`` errors pass through unchanged.
    ``on_retry(exc, attempt, delay)`` runs before each wait; ``rng`` (a
    `random.Random`) draws the policy's jitter.
    """
    if policy is not None and rng is not None:
        policy = policy.with_rng(rng)

    def before_sleep(state: RetryCallState) -> None:
        exc = _exception(state)
        if on_retry is not None and isinstance(exc, Exception):
            on_retry(exc, state.attempt_number, state.upcoming_sleep)

    plan = RetryPlan(
        stop=stop_after_attempt(1) if policy is None else policy.spent,
        wait=wait_none() if policy is None else policy,
        retry=retry_when(classifier, unless=propagate),
        before_sleep=before_sleep,
    )
    attempts = itertools.count(1)
    made = 0

    def attempt() -> T:
        nonlocal made
        made = next(attempts)
        return fn(made)

    try:
        return plan.call(attempt, clock)
    except propagate:
        raise
    except Exception as exc:
        raise RetriesSpent(exc, made) from exc
