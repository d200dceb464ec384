"""The wrapper's options: checked when the decorator runs, resolved against the app on the first batch.

Resolving late lets a module decorate its batch function before the app's
backends are opened. Only ``app.store``, ``app.cache``, ``app.settings`` and
``app.clock`` are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pyspark.sql.types import StructType

from backends.clock import Clock
from backends.errors import ConfigurationError
from reliable.idempotency import Guard
from reliable.retry import Classifier, DelayLevels, RedeliveryPolicy, build_classifier
from reliable.spark import deadletters
from reliable.spark.claim import ClaimStrategy, claim_strategy
from reliable.spark.rows import Validate

DEFAULT_TOKEN_TTL = 7 * 86_400.0
OnRetriesSpent = Literal["fail", "dead_letter"]
Sink = Literal["any", "store"]  # "store": every effect of the function goes through ``tx``
Redelivery = RedeliveryPolicy | DelayLevels


@dataclass(frozen=True)
class WriterOptions:
    """What the decorator was given, checked (`ConfigurationError` names the culprit)."""

    OPTIONS: ClassVar[frozenset[str]] = frozenset({
        "name", "token", "retry", "fatal", "retry_on", "dead_letters", "validate", "schema",
        "on_retries_spent", "checkpoint_location", "ttl", "cache", "sink",
    })  # fmt: skip
    name: str
    token: str
    retry: Redelivery | None
    classifier: Classifier
    dead_letters: str | None
    validate: Validate | None
    schema: StructType | str | None
    on_retries_spent: OnRetriesSpent
    checkpoint_location: str | None
    ttl: float | None
    cache: bool
    sink: Sink

    @classmethod
    def check(
        cls,
        *,
        name: str,
        token: str,
        retry: Redelivery | None = None,
        fatal: tuple[type[BaseException], ...] = (),
        retry_on: tuple[type[BaseException], ...] | None = None,
        dead_letters: str | None = None,
        validate: Validate | None = None,
        schema: StructType | str | None = None,
        on_retries_spent: OnRetriesSpent = "fail",
        checkpoint_location: str | None = None,
        ttl: float | None = None,
        cache: bool = False,
        sink: Sink = "any",
    ) -> WriterOptions:
        _require(isinstance(name, str) and bool(name.strip()), "name", name, "a non-empty string")
        _require(isinstance(token, str) and bool(token.strip()), "token", token, "a column name")
        _require(
            retry is None or isinstance(retry, RedeliveryPolicy | DelayLevels),
            "retry",
            retry,
            "a RedeliveryPolicy or DelayLevels",
        )
        _require(
            on_retries_spent in ("fail", "dead_letter"),
            "on_retries_spent",
            on_retries_spent,
            "'fail' or 'dead_letter'",
        )
        _require(validate is None or callable(validate), "validate", validate, "a callable")
        _require(
            schema is None or isinstance(schema, StructType | str),
            "schema",
            schema,
            "a StructType or a DDL string",
        )
        _require(
            ttl is None or (isinstance(ttl, int | float) and ttl > 0), "ttl", ttl, "seconds > 0"
        )
        _require(isinstance(cache, bool), "cache", cache, "True or False")
        _require(sink in ("any", "store"), "sink", sink, "'any' or 'store'")
        if (validate is not None or on_retries_spent == "dead_letter") and dead_letters is None:
            raise ConfigurationError(
                f"foreach_batch {name!r}: validate= and on_retries_spent='dead_letter' need "
                "dead_letters='<table>' to put refused rows in"
            )
        table = None if dead_letters is None else deadletters.table_for(dead_letters).name
        classifier = build_classifier(fatal=tuple(fatal), retry_on=retry_on)
        return cls(name, token, retry, classifier, table, validate, schema, on_retries_spent,
                   checkpoint_location, ttl, cache, sink)  # fmt: skip


@dataclass(frozen=True)
class Resolved:
    """What a batch needs from the app."""

    store: Any
    guard: Guard  # the cache lookups and the written-behind cache fills of the name's tokens
    clock: Clock
    retry: Redelivery | None
    claim: ClaimStrategy  # how the tokens are claimed around the function (see `claim`)


def resolve(app: Any, options: WriterOptions) -> Resolved:
    """Explicit options first, then the app's ``[handlers.<name>]`` settings, then defaults."""
    settings = _for_handler(getattr(app, "settings", None), options.name)
    ttl = options.ttl or _get(settings, "store", "token_ttl") or DEFAULT_TOKEN_TTL
    retry = options.retry
    if retry is None:
        policy = getattr(_get(settings, "retry"), "policy", None)
        retry = policy() if callable(policy) else None
    cache_ttl = float(_get(settings, "cache", "ttl") or ttl)
    # a micro-batch's tokens are sent to the cache at once, behind the next batch
    guard = Guard(options.name, getattr(app, "cache", None), cache_ttl, float(ttl), fill_batch=1)
    return Resolved(store=app.store, guard=guard, clock=app.clock, retry=retry,
                    claim=claim_strategy(options.sink, guard, app.clock))


def _require(ok: bool, option: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigurationError(
            f"foreach_batch: {option}={value!r} is not allowed; expected {allowed}"
        )


def _for_handler(settings: Any, name: str) -> Any:
    for_handler = getattr(settings, "for_handler", None)
    return for_handler(name) if callable(for_handler) else settings


def _get(settings: Any, *path: str) -> Any:
    value = settings
    for part in path:
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
