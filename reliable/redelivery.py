"""Redelivery policies as tenacity strategies: the delay of a redelivery from its number.

A message that failed is handed back to its transport with the delay a
policy computes from its delivery count (`Message.attempt`): ActiveMQ's
`RedeliveryPolicy` (exponential, capped, jittered) or RocketMQ's
`DelayLevels`. Both are tenacity *wait* strategies (called with tenacity's
`RetryCallState`, they give the delay after that attempt, so they combine
with ``+`` like tenacity's own), and ``policy.spent`` is the matching *stop*
strategy (it combines with ``|`` and ``&``). Work retried where it runs (a
Spark micro-batch) runs them through tenacity; the pipeline asks
``next_delay`` and ``gives_up`` for the one message in hand.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Self, cast

from tenacity import RetryCallState
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from backends.errors import ConfigurationError
from reliable.durations import DURATION_HELP, parse_duration

UNLIMITED = -1
"""``max_redeliveries`` / ``max_delay`` value meaning "no limit" (ActiveMQ's -1)."""

Check = tuple[Callable[[Any], bool], str]
"""A field's test and, in words, what it allows."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def is_count(value: Any, minimum: int) -> bool:
    """``value`` is an integer (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def number(test: Callable[[float], bool], allowed: str) -> Check:
    return (lambda v: _is_number(v) and test(v), allowed)


def count(minimum: int, allowed: str) -> Check:
    return (lambda v: is_count(v, minimum), allowed)


def validate(obj: object, checks: dict[str, Check]) -> None:
    """Raise `ConfigurationError` naming the first field of ``obj`` that fails its check."""
    for name, (test, allowed) in checks.items():
        value = getattr(obj, name)
        if not test(value):
            raise ConfigurationError(f"{type(obj).__name__}.{name} = {value!r} is not allowed; expected {allowed}")


NO_LIMIT = count(UNLIMITED, "an integer >= 0, or -1 for no limit")


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


class RedeliveryWait(wait_base):
    """What both policies share as tenacity strategies: the wait from the attempt number, the stop."""

    rng: random.Random

    @abstractmethod
    def next_delay(self, previous_delay: float | None, rng: random.Random, attempt: int = 1) -> float:
        """Seconds to wait before redelivery number ``attempt`` (see `Redelivery`)."""

    @abstractmethod
    def gives_up(self, attempt: int) -> bool:
        """Whether delivery ``attempt`` failing makes the message poison."""

    def __call__(self, retry_state: RetryCallState) -> float:
        """The delay after attempt ``retry_state.attempt_number`` failed (jitter drawn from ``rng``)."""
        return self.next_delay(None, self.rng, retry_state.attempt_number)

    def with_rng(self, rng: random.Random) -> Self:
        """This policy drawing its jitter from ``rng`` (a seeded one, in tests)."""
        return replace(cast(Any, self), rng=rng)  # type: ignore[no-any-return]

    @property
    def spent(self) -> stop_base:
        """The tenacity stop strategy: stop once the redeliveries are spent."""
        return RedeliveriesSpent(self)


class RedeliveriesSpent(stop_base):
    """Stops once ``policy.gives_up`` the attempt that just failed."""

    def __init__(self, policy: Redelivery) -> None:
        self.policy = policy

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.policy.gives_up(retry_state.attempt_number)


def _rng() -> random.Random:
    return random.Random()


@dataclass(frozen=True)
class RedeliveryPolicy(RedeliveryWait):
    """ActiveMQ's redelivery policy: each delay grows from the previous one, capped and jittered.

    ``jitter`` is ActiveMQ's collision avoidance: the delay moves by up to
    ± that fraction. ``max_delay`` and ``max_redeliveries`` accept -1 (no limit).
    Delays are float seconds (ActiveMQ truncates to whole milliseconds).
    ``rng`` draws the jitter where the policy runs as a tenacity wait.
    """

    initial_delay: float = 1.0
    multiplier: float = 5.0
    max_delay: float = 600.0
    jitter: float = 0.0
    max_redeliveries: int = 6
    use_exponential_backoff: bool = True
    rng: random.Random = field(default_factory=_rng, compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        validate(self, {
            "initial_delay": number(lambda v: v >= 0, "seconds >= 0"),
            "multiplier": number(lambda v: v >= 1, "a number >= 1"),
            "max_delay": number(lambda v: v >= 0 or v == UNLIMITED, "seconds >= 0, or -1 for no cap"),
            "jitter": number(lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
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
class DelayLevels(RedeliveryWait):
    """RocketMQ's fixed delay levels: redelivery n waits level ``start_level + n - 1``.

    Levels are numbered from 1; past the last level the last one repeats (as
    RocketMQ clamps to its maximum level). RocketMQ retries a consumer's
    message at level 3 + reconsumeTimes and gives up after 16 reconsumes.
    ``levels`` accepts durations (``"30s"``) or seconds and holds seconds.
    """

    levels: tuple[float | str, ...] = ROCKETMQ_DELAY_LEVELS
    start_level: int = 3
    max_redeliveries: int = 16
    rng: random.Random = field(default_factory=_rng, compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        validate(self, {"levels": (lambda v: isinstance(v, tuple | list) and len(v) > 0, "a non-empty list")})
        seconds = []
        for index, level in enumerate(self.levels):
            try:
                seconds.append(parse_duration(level))
            except ConfigurationError:
                raise ConfigurationError(
                    f"DelayLevels.levels[{index}] = {level!r} is not allowed; expected {DURATION_HELP}"
                ) from None
        object.__setattr__(self, "levels", tuple(seconds))
        validate(self, {
            "start_level": (lambda v: is_count(v, 1) and v <= len(seconds), f"a level from 1 to {len(seconds)}"),
            "max_redeliveries": NO_LIMIT,
        })

    def next_delay(self, previous_delay: float | None, rng: random.Random, attempt: int = 1) -> float:
        """The delay of level ``start_level + attempt - 1``; ``previous_delay`` plays no part."""
        level = min(self.start_level + max(attempt, 1) - 1, len(self.levels))
        return float(self.levels[level - 1])

    def gives_up(self, attempt: int) -> bool:
        """True once ``attempt - 1`` redeliveries (RocketMQ's reconsumeTimes) reach the maximum."""
        return self.max_redeliveries != UNLIMITED and attempt - 1 >= self.max_redeliveries
