"""The `@app.handler(...)` decorator: a registered handler and its validated options.

Options are validated when the decorator runs (an unknown token spec, a
negative batch size, a lease without a positive expiry: `HandlerOptionError`
naming the option). Settings that are not given on the decorator (retry
policy, in-process retry, TTLs, commit strategy, concurrency) are resolved
from the settings file, per handler, when the app starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.store.base import Transaction
from backends.types import Message
from reliable.commit import STRATEGIES, CommitStrategy
from reliable.errors import HandlerOptionError
from reliable.idempotency import Token, TokenFunction
from reliable.retry import (
    Classifier,
    DelayLevels,
    InProcessRetry,
    RedeliveryPolicy,
    build_classifier,
)

Redelivery = RedeliveryPolicy | DelayLevels
HandlerFunction = Callable[..., Any]


@dataclass(frozen=True)
class HandlerConfig:
    """A handler's effective settings: decorator options over the settings file."""

    redelivery: Redelivery
    in_process: InProcessRetry
    token_ttl: float
    cache_ttl: float
    commit: str | CommitStrategy
    commit_batch_size: int
    commit_interval: float
    concurrency: int
    prefetch: int
    poll_timeout: float


class Handler:
    """A function registered to consume a topic for a group, with its reliability options."""

    def __init__(
        self,
        func: HandlerFunction,
        topic: str,
        *,
        group: str | None = None,
        name: str | None = None,
        token: str | TokenFunction | Token | None = "id",
        retry: Redelivery | None = None,
        fatal: Sequence[type[BaseException]] = (),
        retry_on: Sequence[type[BaseException]] | None = None,
        retry_if: Callable[[BaseException], bool] | None = None,
        in_process: InProcessRetry | int | None = None,
        batch: int | None = None,
        lease: float | None = None,
        commit: str | CommitStrategy | None = None,
        concurrency: int | None = None,
        prefetch: int | None = None,
    ) -> None:
        self.func = func
        self.name = name or func.__name__
        self.topic = _require_name("topic", topic)
        self.group = _require_name("group", group or self.name)
        self.token = None if token is None else Token.parse(token)
        self.classifier: Classifier = build_classifier(fatal=tuple(fatal), retry_on=retry_on, predicate=retry_if)
        self.retry = _check_type("retry", retry, (RedeliveryPolicy, DelayLevels))
        self.in_process = InProcessRetry(attempts=in_process) if isinstance(in_process, int) else in_process
        self.batch = _positive("batch", batch)
        self.lease = _positive("lease", lease)
        self.commit = _check_commit(commit)
        self.concurrency = _positive("concurrency", concurrency)
        self.prefetch = _positive("prefetch", prefetch)
        if self.batch and self.lease:
            raise HandlerOptionError(f"handler {self.name!r}: batch= and lease= cannot be combined")
        self._takes_tx = _takes_transaction(func)
        self.config: HandlerConfig  # set by App when it starts

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the undecorated function (for unit tests of the handler's own logic)."""
        return self.func(*args, **kwargs)

    def call(self, message: Message, tx: Transaction | None) -> Any:
        return self.func(message, tx) if self._takes_tx else self.func(message)

    def call_batch(self, messages: list[Message], tx: Transaction) -> Any:
        return self.func(messages, tx) if self._takes_tx else self.func(messages)

    def __repr__(self) -> str:
        return f"<Handler {self.name} topic={self.topic} group={self.group}>"


def _require_name(option: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value.startswith("%"):
        raise HandlerOptionError(f"{option}={value!r} is not allowed; expected a non-empty name not starting with '%'")
    return value


def _positive(option: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise HandlerOptionError(f"{option}={value!r} is not allowed; expected a positive number")
    return value


def _check_type(option: str, value: Any, types: tuple[type, ...]) -> Any:
    if value is not None and not isinstance(value, types):
        allowed = " or ".join(t.__name__ for t in types)
        raise HandlerOptionError(f"{option}={value!r} is not allowed; expected {allowed}")
    return value


def _check_commit(value: Any) -> str | CommitStrategy | None:
    if value is None or isinstance(value, CommitStrategy) or value in STRATEGIES:
        return value
    raise HandlerOptionError(f"commit={value!r} is not allowed; expected one of {', '.join(STRATEGIES)}")


def _takes_transaction(func: HandlerFunction) -> bool:
    try:
        params = [
            p for p in inspect.signature(func).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        return True
    if not params:
        raise HandlerOptionError(f"handler {getattr(func, '__name__', func)!r} must accept the message")
    return len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
