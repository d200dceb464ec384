"""Redelivery policies, exception classification and the in-process retry bridge to tenacity.

A failing message is first retried in process (`call_with_retry`: a few quick
attempts through tenacity), then handed back to the transport with the delay a
`Redelivery` strategy computes: ActiveMQ's `RedeliveryPolicy` (exponential,
capped, jittered) or RocketMQ's `DelayLevels`. A `Classifier` decides which
exceptions are worth retrying at all; the others make the message poison.
"""

from __future__ import annotations

import enum
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from backends.clock import Clock
from backends.errors import BodyDecodeError, ConfigurationError
from reliable.errors import TokenMissingError

T = TypeVar("T")

UNLIMITED = -1
"""``max_redeliveries`` / ``max_delay`` value meaning "no limit" (ActiveMQ's -1)."""

DURATION_HELP = "seconds as a number, or a number followed by ms, s, m, h or d (e.g. '30s', '5m', '2h')"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | float) -> float:
    """Seconds in ``value``: a number of seconds, or a string such as ``'500ms'``, ``'5m'``, ``'2h'``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(value) if isinstance(value, str) else None
        if match is None:
            raise ConfigurationError(f"{value!r} is not a duration; expected {DURATION_HELP}")
        seconds = float(match[1]) * _UNIT_SECONDS[match[2] or "s"]
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigurationError(f"{value!r} is not a duration; expected a finite number of seconds >= 0")
    return seconds


def _require(ok: bool, owner: str, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigurationError(f"{owner}.{name} = {value!r} is not allowed; expected {allowed}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


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
        name = type(self).__name__
        delay, cap = self.initial_delay, self.max_delay
        _require(_is_number(delay) and delay >= 0, name, "initial_delay", delay, "seconds >= 0")
        _require(_is_number(self.multiplier) and self.multiplier >= 1, name, "multiplier", self.multiplier,
                 "a number >= 1")
        _require(_is_number(cap) and (cap >= 0 or cap == UNLIMITED), name, "max_delay", cap,
                 "seconds >= 0, or -1 for no cap")
        _require(_is_number(self.jitter) and 0 <= self.jitter < 1, name, "jitter", self.jitter,
                 "a fraction in [0, 1)")
        _require(_is_count(self.max_redeliveries, UNLIMITED), name, "max_redeliveries",
                 self.max_redeliveries, "an integer >= 0, or -1 for no limit")

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
        name = type(self).__name__
        levels = self.levels
        _require(isinstance(levels, Sequence) and not isinstance(levels, str) and len(levels) > 0,
                 name, "levels", levels, "a non-empty list of durations")
        seconds = []
        for index, level in enumerate(levels):
            try:
                seconds.append(parse_duration(level))
            except ConfigurationError:
                _require(False, name, f"levels[{index}]", level, DURATION_HELP)
        object.__setattr__(self, "levels", tuple(seconds))
        _require(_is_count(self.start_level, 1) and self.start_level <= len(seconds), name, "start_level",
                 self.start_level, f"a level number from 1 to {len(seconds)}")
        _require(_is_count(self.max_redeliveries, UNLIMITED), name, "max_redeliveries",
                 self.max_redeliveries, "an integer >= 0, or -1 for no limit")

    def next_delay(self, previous_delay: float | None, rng: random.Random, attempt: int = 1) -> float:
        """The delay of level ``start_level + attempt - 1``; ``previous_delay`` plays no part."""
        level = min(self.start_level + max(attempt, 1) - 1, len(self.levels))
        return float(self.levels[level - 1])

    def gives_up(self, attempt: int) -> bool:
        """True once ``attempt - 1`` redeliveries (RocketMQ's reconsumeTimes) reach the maximum."""
        return self.max_redeliveries != UNLIMITED and attempt - 1 >= self.max_redeliveries


# -- classification -----------------------------------------------------------


class Verdict(enum.Enum):
    """What a failure deserves: another try, or the dead-letter queue."""

    RETRY = "retry"
    FATAL = "fatal"


Classifier = Callable[[BaseException], "Verdict | None"]
"""Any callable giving an exception a `Verdict`, or None for "no opinion"."""


class Rule:
    """A composable classifier: ``a | b`` asks ``a`` first and ``b`` only if ``a`` has no opinion.

    Any plain callable with the `Classifier` signature composes with a rule.
    """

    def __call__(self, exc: BaseException) -> Verdict | None:
        raise NotImplementedError

    def __or__(self, other: Classifier) -> Rule:
        return _FirstOpinion((self, other))

    def __ror__(self, other: Classifier) -> Rule:
        return _FirstOpinion((other, self))


class _OnTypes(Rule):
    def __init__(self, types: Sequence[type[BaseException]], verdict: Verdict, option: str) -> None:
        for kind in types:
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise ConfigurationError(f"{option}: {kind!r} is not allowed; expected exception classes")
        self.types = tuple(types)
        self.verdict = verdict

    def __call__(self, exc: BaseException) -> Verdict | None:
        return self.verdict if self.types and isinstance(exc, self.types) else None

    def __repr__(self) -> str:
        return f"{self.verdict.value}_on({', '.join(t.__name__ for t in self.types)})"


class _When(Rule):
    def __init__(self, predicate: Callable[[BaseException], bool], verdict: Verdict) -> None:
        self.predicate = predicate
        self.verdict = verdict

    def __call__(self, exc: BaseException) -> Verdict | None:
        return self.verdict if self.predicate(exc) else None

    def __repr__(self) -> str:
        return f"when({self.predicate!r}, {self.verdict})"


class _Always(Rule):
    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict

    def __call__(self, exc: BaseException) -> Verdict | None:
        return self.verdict

    def __repr__(self) -> str:
        return f"always({self.verdict})"


class _FirstOpinion(Rule):
    classifiers: tuple[Classifier, ...]

    def __init__(self, classifiers: Sequence[Classifier]) -> None:
        flat: list[Classifier] = []
        for classifier in classifiers:
            flat.extend(classifier.classifiers if isinstance(classifier, _FirstOpinion) else [classifier])
        self.classifiers = tuple(flat)

    def __call__(self, exc: BaseException) -> Verdict | None:
        for classifier in self.classifiers:
            verdict = classifier(exc)
            if verdict is not None:
                return verdict
        return None

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.classifiers))


def fatal_on(*types: type[BaseException]) -> Rule:
    """FATAL for instances of ``types``, no opinion otherwise."""
    return _OnTypes(types, Verdict.FATAL, "fatal_on")


def retry_on(*types: type[BaseException]) -> Rule:
    """RETRY for instances of ``types``, no opinion otherwise."""
    return _OnTypes(types, Verdict.RETRY, "retry_on")


def when(predicate: Callable[[BaseException], bool], verdict: Verdict) -> Rule:
    """``verdict`` when ``predicate(exc)`` is true, no opinion otherwise."""
    return _When(predicate, verdict)


POISON: tuple[type[BaseException], ...] = (BodyDecodeError, TokenMissingError)
"""Failures `reliable` itself detects in the message: no retry can fix them."""


def classify(exc: BaseException, classifier: Classifier | None = None) -> Verdict:
    """The verdict on ``exc``: poison detected by `reliable` is FATAL whatever the classifier
    says; otherwise the classifier's opinion; with no opinion, RETRY."""
    if isinstance(exc, POISON):
        return Verdict.FATAL
    verdict = classifier(exc) if classifier is not None else None
    if verdict is None:
        return Verdict.RETRY
    if not isinstance(verdict, Verdict):
        raise ConfigurationError(f"classifier {classifier!r} returned {verdict!r}; expected a Verdict or None") from exc
    return verdict


def build_classifier(
    fatal: Sequence[type[BaseException]] = (),
    retry_on: Sequence[type[BaseException]] | None = None,
    predicate: Callable[[BaseException], bool] | None = None,
) -> Rule:
    """The classifier behind the handler options, asked in this order:

    * ``fatal``: these exceptions are FATAL;
    * ``retry_on``: these exceptions are RETRY; when given (even empty), every
      other exception is FATAL, unless ``predicate`` is given too;
    * ``predicate``: decides every exception the lists do not name: true is
      RETRY, false is FATAL (tenacity's ``retry_if_exception``).
    Without ``retry_on`` and ``predicate`` everything not ``fatal`` is RETRY.
    """
    rules: list[Classifier] = [_OnTypes(tuple(fatal), Verdict.FATAL, "fatal")]
    if retry_on is not None:
        rules.append(_OnTypes(tuple(retry_on), Verdict.RETRY, "retry_on"))
    if predicate is not None:
        rules.append(_When(predicate, Verdict.RETRY) | _Always(Verdict.FATAL))
    elif retry_on is not None:
        rules.append(_Always(Verdict.FATAL))
    return _FirstOpinion(rules)


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
        name = type(self).__name__
        _require(_is_count(self.attempts, 1), name, "attempts", self.attempts, "an integer >= 1")
        _require(_is_number(self.initial_wait) and self.initial_wait >= 0, name, "initial_wait",
                 self.initial_wait, "seconds >= 0")
        _require(_is_number(self.max_wait) and self.max_wait >= 0, name, "max_wait", self.max_wait,
                 "seconds >= 0")
        _require(_is_number(self.multiplier) and self.multiplier >= 1, name, "multiplier",
                 self.multiplier, "a number >= 1")


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

    def retryable(exc: BaseException) -> bool:
        return isinstance(exc, Exception) and classify(exc, classifier) is Verdict.RETRY

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            exc = state.outcome.exception()
            assert exc is not None
            on_retry(exc, state.attempt_number)

    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait_exponential(multiplier=policy.initial_wait, exp_base=policy.multiplier, max=policy.max_wait),
        retry=retry_if_exception(retryable),
        sleep=clock.sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(fn)
