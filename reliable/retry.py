"""Redelivery policies and the in-process retry bridge to tenacity.

A failing message is first retried in process (`call_with_retry`: a few quick
attempts through tenacity), then handed back to the transport with the delay a
`Redelivery` strategy computes: ActiveMQ's `RedeliveryPolicy` (exponential,
capped, jittered) or RocketMQ's `DelayLevels`. Which exceptions are worth
retrying at all is decided in `reliable.classify` (re-exported here, as are
the durations of `reliable.durations`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from backends.clock import Clock
from backends.errors import ConfigurationError
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

__all__ = [
    "DURATION_HELP",
    "NO_LIMIT",
    "POISON",
    "ROCKETMQ_DELAY_LEVELS",
    "UNLIMITED",
    "Check",
    "Classifier",
    "DelayLevels",
    "InProcessRetry",
    "Redelivery",
    "RedeliveryPolicy",
    "RetriesSpent",
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

UNLIMITED = -1
"""``max_redeliveries`` / ``max_delay`` value meaning "no limit" (ActiveMQ's -1)."""


Check = tuple[Callable[[Any], bool], str]
"""A field's test and, in words, what it allows."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _number(test: Callable[[float], bool], allowed: str) -> Check:
    return (lambda v: _is_number(v) and test(v), allowed)


def _count(minimum: int, allowed: str) -> Check:
    return (lambda v: _is_count(v, minimum), allowed)


def _validate(obj: object, checks: dict[str, Check]) -> None:
    """Raise `ConfigurationError` naming the first field of ``obj`` that fails its check."""
    for name, (test, allowed) in checks.items():
        value = getattr(obj, name)
        if not test(value):
            raise ConfigurationError(f"{type(obj).__name__}.{name} = {value!r} is not allowed; expected {allowed}")


NO_LIMIT = _count(UNLIMITED, "an integer >= 0, or -1 for no limit")


# -- redelivery ---------------------------------------------------------------


class Redelivery(Protocol):
    """When a failed message is delivered again, and when its redeliveries are spent.

    ``attempt`` is always the 1-based delivery count of the message that just
    failed (`Message.attempt`): delivery ``attempt`` failing asks for
    redelivery number ``attempt``.
    """

    def next_delay(self, previous_delay: float | None, rng: random.Random, attempt: int = 1) -> float:
        """Seconds to wait before redelivering; ``previous_delay`` is what it waited last time."""
        ...

    def gives_up(self, attempt: int) -> bool:
        """Whether delivery ``attempt`` failing makes the message poison."""
        ...


@dataclass(frozen=True)
class RedeliveryPolicy:
    """ActiveMQ's redelivery policy: each delay grows from the previous one, capped and jittered.

    ``jitter`` is ActiveMQ's collision avoidance: the delay moves by up to
    ± that fraction. ``max_delay`` and ``max_redeliveries`` accept -1 (no limit).
    Delays are float seconds (ActiveMQ truncates to whole milliseconds).
    """

    initial_delay: float = 1.0
    multiplier: float = 5.0
    max_delay: float = 600.0
    jitter: float = 0.0
    max_redeliveries: int = 6
    use_exponential_backoff: bool = True

    def __post_init__(self) -> None:
        _validate(self, {
            "initial_delay": _number(lambda v: v >= 0, "seconds >= 0"),
            "multiplier": _number(lambda v: v >= 1, "a number >= 1"),
            "max_delay": _number(lambda v: v >= 0 or v == UNLIMITED, "seconds >= 0, or -1 for no cap"),
            "jitter": _number(lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
            "max_redeliveries": NO_LIMIT,
        })

    def next_delay(self, previous_delay: float | None, rng: random.Random, attempt: int = 1) -> float:
        """ActiveMQ's ``getNextRedeliveryDelay``, then collision avoidance (two draws: sign, size).

        When ``previous_delay`` is unknown (None) for a redelivery after the
        first, the un-jittered delay of the previous redelivery stands in for it.
        """
        if previous_delay is None and attempt > 1:
            previous_delay = self._nominal_delay(attempt - 1)
        delay = self._grow(previous_delay)
        if self.jitter > 0:
            variance = (self.jitter if rng.random() < 0.5 else -self.jitter) * rng.random()
            delay += delay * variance
        return delay

    def gives_up(self, attempt: int) -> bool:
        """True once ``attempt - 1`` redeliveries have reached ``max_redeliveries``."""
        return self.max_redeliveries != UNLIMITED and attempt - 1 >= self.max_redeliveries

    def _grow(self, previous_delay: float | None) -> float:
        if not previous_delay or previous_delay <= 0:
            return self.initial_delay
        if not (self.use_exponential_backoff and self.multiplier > 1):
            return self.initial_delay
        delay = previous_delay * self.multiplier
        if self.max_delay != UNLIMITED and delay > self.max_delay:
            delay = max(self.max_delay, self.initial_delay)  # max_delay below initial_delay: keep initial
        return delay

    def _nominal_delay(self, redelivery: int) -> float:
        """The un-jittered delay of redelivery number ``redelivery`` (>= 1), in closed form."""
        growing = self.use_exponential_backoff and self.multiplier > 1 and self.initial_delay > 0
        if not growing:
            return self.initial_delay
        try:
            delay = self.initial_delay * self.multiplier ** (redelivery - 1)
        except OverflowError:
            delay = math.inf
        if self.max_delay != UNLIMITED and delay > self.max_delay:
            delay = max(self.max_delay, self.initial_delay)
        return delay


ROCKETMQ_DELAY_LEVELS: tuple[str, ...] = (
    "1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m",
    "6m", "7m", "8m", "9m", "10m", "20m", "30m", "1h", "2h",
)  # fmt: skip
"""RocketMQ's default ``messageDelayLevel`` (levels are numbered from 1)."""


@dataclass(frozen=True)
class DelayLevels:
    """RocketMQ's fixed delay levels: redelivery n waits level ``start_level + n - 1``.

    Levels are numbered from 1; past the last level the last one repeats (as
    RocketMQ clamps to its maximum level). RocketMQ retries a consumer's
    message at level 3 + reconsumeTimes and gives up after 16 reconsumes.
    ``levels`` accepts durations (``"30s"``) or seconds and holds seconds.
    """

    levels: tuple[float | str, ...] = ROCKETMQ_DELAY_LEVELS
    start_level: int = 3
    max_redeliveries: int = 16

    def __post_init__(self) -> None:
        _validate(self, {"levels": (lambda v: isinstance(v, tuple | list) and len(v) > 0, "a non-empty list")})
        seconds = []
        for index, level in enumerate(self.levels):
            try:
                seconds.append(parse_duration(level))
            except ConfigurationError:
                raise ConfigurationError(
                    f"DelayLevels.levels[{index}] = {level!r} is not allowed; expected {DURATION_HELP}"
                ) from None
        object.__setattr__(self, "levels", tuple(seconds))
        _validate(self, {
            "start_level": (lambda v: _is_count(v, 1) and v <= len(seconds), f"a level from 1 to {len(seconds)}"),
            "max_redeliveries": NO_LIMIT,
        })

    def next_delay(self, previous_delay: float | None, rng: random.Random, attempt: int = 1) -> float:
        """The delay of level ``start_level + attempt - 1``; ``previous_delay`` plays no part."""
        level = min(self.start_level + max(attempt, 1) - 1, len(self.levels))
        return float(self.levels[level - 1])

    def gives_up(self, attempt: int) -> bool:
        """True once ``attempt - 1`` redeliveries (RocketMQ's reconsumeTimes) reach the maximum."""
        return self.max_redeliveries != UNLIMITED and attempt - 1 >= self.max_redeliveries


# -- in-process retry ---------------------------------------------------------


@dataclass(frozen=True)
class InProcessRetry:
    """A few quick retries inside the worker before the message goes back to the broker.

    ``attempts`` counts calls (1: no retry); the wait after call n is
    ``initial_wait * multiplier ** (n - 1)``, at most ``max_wait``.
    """

    attempts: int = 3
    initial_wait: float = 0.05
    max_wait: float = 1.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        _validate(self, {
            "attempts": _count(1, "an integer >= 1"),
            "initial_wait": _number(lambda v: v >= 0, "seconds >= 0"),
            "max_wait": _number(lambda v: v >= 0, "seconds >= 0"),
            "multiplier": _number(lambda v: v >= 1, "a number >= 1"),
        })


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
    The first call runs without tenacity (the common case costs nothing); only
    after a retryable failure do the remaining calls go through `Retrying`.
    """
    try:
        return fn()
    except Exception as exc:
        _first_failed(exc, policy, classifier, on_retry)
    clock.sleep(min(policy.initial_wait, policy.max_wait))
    return Retrying(sleep=clock.sleep, **_retrying(policy, classifier, on_retry))(fn)


async def call_with_retry_async(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: InProcessRetry,
    classifier: Classifier | None = None,
    sleep: Callable[[float], Awaitable[None]],
    on_retry: Callable[[BaseException, int], Any] | None = None,
) -> T:
    """`call_with_retry` for a coroutine function, awaiting ``sleep`` between calls
    (tenacity's `AsyncRetrying`): the same policy, classification and numbering."""
    try:
        return await fn()
    except Exception as exc:
        _first_failed(exc, policy, classifier, on_retry)
    await sleep(min(policy.initial_wait, policy.max_wait))

    async def attempt() -> T:  # a coroutine function, so tenacity awaits what ``fn`` returns
        return await fn()

    result: T = await AsyncRetrying(sleep=sleep, **_retrying(policy, classifier, on_retry))(attempt)
    return result


def _retryable(classifier: Classifier | None) -> Callable[[BaseException], bool]:
    return lambda exc: isinstance(exc, Exception) and classify(exc, classifier) is Verdict.RETRY


def _first_failed(exc: Exception, policy: InProcessRetry, classifier: Classifier | None,
                  on_retry: Callable[[BaseException, int], Any] | None) -> None:
    """Re-raise the first call's ``exc`` unless it is worth another call; report the retry."""
    if policy.attempts == 1 or not _retryable(classifier)(exc):
        raise exc
    if on_retry is not None:
        on_retry(exc, 1)


def _retrying(policy: InProcessRetry, classifier: Classifier | None,
              on_retry: Callable[[BaseException, int], Any] | None) -> dict[str, Any]:
    """The tenacity options of the calls after the first (stop, wait, retry, reporting)."""

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            exc = state.outcome.exception()
            assert exc is not None
            on_retry(exc, state.attempt_number + 1)  # numbered from the first call

    return {
        "stop": stop_after_attempt(policy.attempts - 1),
        "wait": wait_exponential(
            multiplier=policy.initial_wait * policy.multiplier, exp_base=policy.multiplier, max=policy.max_wait
        ),
        "retry": retry_if_exception(_retryable(classifier)),
        "before_sleep": before_sleep,
        "reraise": True,
    }


class RetriesSpent(Exception):
    """Raised by `call_with_redelivery` when a call failed FATAL or its policy gave up."""

    def __init__(self, error: Exception, attempts: int) -> None:
        super().__init__(f"{type(error).__name__} after {attempts} attempt(s): {error}")
        self.error = error
        self.attempts = attempts


def call_with_redelivery(
    fn: Callable[[int], T],
    *,
    policy: Redelivery | None,
    classifier: Classifier | None,
    clock: Clock,
    rng: random.Random,
    propagate: tuple[type[Exception], ...] = (),
    on_retry: Callable[[Exception, int, float], Any] | None = None,
) -> T:
    """``fn(attempt)`` until it succeeds, waiting the policy's growing delays between failures.

    For work that is retried where it runs, with a redelivery policy's backoff
    (a Spark micro-batch: there is no transport to redeliver it). A FATAL
    failure, or one after which ``policy`` gives up (no policy: at once), raises
    `RetriesSpent` from it; ``propagate`` errors pass through unchanged.
    ``on_retry(exc, attempt, delay)`` runs before each wait.
    """
    delay: float | None = None
    attempt = 1
    while True:
        try:
            return fn(attempt)
        except propagate:
            raise
        except Exception as exc:
            fatal = classify(exc, classifier) is Verdict.FATAL
            if fatal or policy is None or policy.gives_up(attempt):
                raise RetriesSpent(exc, attempt) from exc
            delay = policy.next_delay(delay, rng, attempt)
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            clock.sleep(delay)
            attempt += 1
