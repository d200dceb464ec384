"""Exception classification: which failures are worth another try, and which make a message poison.

A `Classifier` is any callable giving an exception a `Verdict` (or no opinion);
`Rule` objects compose with ``|`` (the first opinion wins), like tenacity's
retry strategies. `classify` applies one, with `POISON` always FATAL.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from sqlalchemy import exc as sa_exc

from backends.errors import BodyDecodeError, ConfigurationError, UnreadableMessageError
from reliable.errors import HandlerShapeError, TokenInvalidError, TokenMissingError


class Verdict(enum.Enum):
    """What a failure deserves: another try, or the dead-letter queue."""

    RETRY = "retry"
    FATAL = "fatal"


Classifier = Callable[[BaseException], "Verdict | None"]
"""Any callable giving an exception a `Verdict`, or None for "no opinion"."""


class Rule:
    """A composable classifier: ``a | b`` asks ``a`` first, and ``b`` only when ``a`` has no opinion.

    Any plain callable with the `Classifier` signature composes with a rule.
    """

    def __init__(self, *classifiers: Classifier, name: str = "") -> None:
        self.classifiers = classifiers
        self.name = name or " | ".join(map(repr, classifiers))

    def __call__(self, exc: BaseException) -> Verdict | None:
        for classifier in self.classifiers:
            verdict = classifier(exc)
            if verdict is not None:
                return verdict
        return None

    def __or__(self, other: Classifier) -> Rule:
        return Rule(self, other)

    def __ror__(self, other: Classifier) -> Rule:
        return Rule(other, self)

    def __repr__(self) -> str:
        return self.name


def _on_types(types: Sequence[type[BaseException]], verdict: Verdict, option: str) -> Rule:
    for kind in types:
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            raise ConfigurationError(f"{option}: {kind!r} is not allowed; expected exception classes")
    kinds = tuple(types)
    name = f"{option}({', '.join(kind.__name__ for kind in kinds)})"
    return Rule(lambda exc: verdict if kinds and isinstance(exc, kinds) else None, name=name)


def fatal_on(*types: type[BaseException]) -> Rule:
    """FATAL for instances of ``types``, no opinion otherwise."""
    return _on_types(types, Verdict.FATAL, "fatal_on")


def retry_on(*types: type[BaseException]) -> Rule:
    """RETRY for instances of ``types``, no opinion otherwise."""
    return _on_types(types, Verdict.RETRY, "retry_on")


def when(predicate: Callable[[BaseException], bool], verdict: Verdict) -> Rule:
    """``verdict`` when ``predicate(exc)`` is true, no opinion otherwise."""
    if not callable(predicate) or not isinstance(verdict, Verdict):
        raise ConfigurationError(f"when({predicate!r}, {verdict!r}) is not allowed; expected a callable and a Verdict")
    return Rule(lambda exc: verdict if predicate(exc) else None, name=f"when({predicate!r}, {verdict.name})")


def _always(verdict: Verdict) -> Rule:
    return Rule(lambda exc: verdict, name=f"always({verdict.name})")


POISON: tuple[type[BaseException], ...] = (
    BodyDecodeError, UnreadableMessageError, TokenMissingError, TokenInvalidError, HandlerShapeError
)
"""Failures `reliable` itself detects in the message: no retry can fix them."""

_MISSING_SCHEMA = ("no such table", "no such column", "has no column named")
"""SQLite reports a missing table or column as an OperationalError; these are its words."""


def _sql_programming_error(exc: BaseException) -> bool:
    """A statement that can never succeed as written: a missing table or column, bad SQL."""
    if isinstance(exc, sa_exc.ProgrammingError):  # PostgreSQL: UndefinedTable, UndefinedColumn, syntax
        return True
    return isinstance(exc, sa_exc.OperationalError) and any(
        words in str(exc.orig) for words in _MISSING_SCHEMA
    )


NEVER_FIXED_BY_RETRY = Rule(
    fatal_on(TypeError, AttributeError, NameError),
    when(_sql_programming_error, Verdict.FATAL),
    name="never_fixed_by_retry",
)
"""FATAL by default: bugs and schema errors no retry can fix (a handler's own classifier
is asked first, so ``retry_on=(TypeError,)`` still retries a TypeError)."""


def classify(exc: BaseException, classifier: Classifier | None = None) -> Verdict:
    """The verdict on ``exc``: poison detected by `reliable` is FATAL whatever the classifier
    says; otherwise the classifier's opinion; with no opinion, `NEVER_FIXED_BY_RETRY`'s;
    with none either, RETRY."""
    if isinstance(exc, POISON):
        return Verdict.FATAL
    verdict = classifier(exc) if classifier is not None else None
    if verdict is None:
        return NEVER_FIXED_BY_RETRY(exc) or Verdict.RETRY
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
    rules = [_on_types(tuple(fatal), Verdict.FATAL, "fatal")]
    if retry_on is not None:
        rules.append(_on_types(tuple(retry_on), Verdict.RETRY, "retry_on"))
    if predicate is not None:
        rules.append(when(predicate, Verdict.RETRY) | _always(Verdict.FATAL))
    elif retry_on is not None:
        rules.append(_always(Verdict.FATAL))
    return Rule(*rules)
