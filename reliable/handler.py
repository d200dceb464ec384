"""The `@app.handler(...)` decorator: a registered handler and its validated options.

A handler is a plain function ``(message[, tx])`` or an ``async def`` one,
whose ``tx`` is then the store's async transaction (`backends.store.aio`)
and which runs with many messages in flight on one event loop.

Options are validated when the decorator runs (an unknown token spec, a
negative batch size, a lease without a positive expiry: `HandlerOptionError`
naming the option), and so is the handler's shape: a generator or async
generator function, or a non-callable, would let the pipeline ack messages
whose body never ran, so it is refused. A handler that still hands back
something unfinished (a lambda returning a generator) fails the message as
poison (`HandlerShapeError`), never counted processed. Settings that are not given on the decorator (retry
policy, in-process retry, TTLs, commit strategy, concurrency) are resolved
from the settings file, per handler, when the app starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.types import Message
from backends.values import positive
from reliable.commit import STRATEGIES, CommitStrategy
from reliable.errors import HandlerOptionError, HandlerShapeError
from reliable.idempotency import Token, TokenFunction
from reliable.retry import (
    Classifier,
    DelayLevels,
    InProcessRetry,
    RedeliveryPolicy,
    build_classifier,
)
from reliable.typed import BodyType

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
        _check_shape(func)
        self.func = func
        self.name = name or _name(func)
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
        self._body = BodyType.of(func)
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)
        self.config: HandlerConfig  # set by App when it starts

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the undecorated function (for unit tests of the handler's own logic)."""
        return self.func(*args, **kwargs)

    async def run(self, message: Message, tx: Any) -> Any:
        """Run the handler's body on one message to its end (awaited when it is ``async def``).

        A typed handler gets the body validated into its annotation (`BodyType`)."""
        argument = message if self._body is None else self._body.argument(message)
        return await self._ran(self.func(argument, tx) if self._takes_tx else self.func(argument))

    async def run_batch(self, messages: list[Message], tx: Any) -> Any:
        """Run the handler's body on a batch to its end (batch mode)."""
        return await self._ran(self.func(messages, tx) if self._takes_tx else self.func(messages))

    async def _ran(self, value: Any) -> Any:
        """What the body returned: an async handler's coroutine awaited, and never a body that
        has not run (`HandlerShapeError`)."""
        if self.is_async and inspect.iscoroutine(value):
            value = await value
        return self._finished(value)

    def _finished(self, value: Any) -> Any:
        """``value``, unless it is a body that has not run yet (`HandlerShapeError`)."""
        if inspect.isawaitable(value) or inspect.isgenerator(value) or inspect.isasyncgen(value):
            if inspect.iscoroutine(value) or inspect.isgenerator(value):
                value.close()  # never started: closing it runs nothing and silences the warning
            raise HandlerShapeError(
                f"handler {self.name!r} returned {type(value).__name__} {value!r} instead of "
                "running its body; the message is not counted processed"
            )
        return value

    def __repr__(self) -> str:
        return f"<Handler {self.name} topic={self.topic} group={self.group}>"


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", None) or type(func).__name__)


_UNRUNNABLE = (
    (inspect.isasyncgenfunction, "an async generator function"),
    (inspect.isgeneratorfunction, "a generator function"),
)
"""Handler shapes whose call returns without running the body, and how to name them."""


def _check_shape(func: Any) -> None:
    """Refuse a handler the pipeline could not run to completion (at decoration time)."""
    if not callable(func):
        raise HandlerOptionError(f"handler {func!r} is not callable; decorate a function taking the message")
    for test, shape in _UNRUNNABLE:
        if test(func) or test(type(func).__call__):
            raise HandlerOptionError(
                f"handler {_name(func)!r} is {shape}: calling it would not run its body, so its "
                "messages would be acknowledged unhandled; write a plain function that returns"
            )


def _require_name(option: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value.startswith("%"):
        raise HandlerOptionError(f"{option}={value!r} is not allowed; expected a non-empty name not starting with '%'")
    return value


def _positive(option: str, value: Any) -> Any:
    return None if value is None else positive(option, value, HandlerOptionError)


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
    """Whether ``func`` is called ``(message, tx)`` rather than ``(message)``; a signature that
    takes neither (no parameter, a third required one, a required keyword) is refused here,
    where its every message would otherwise be dead-lettered with a `TypeError`."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return True
    for arguments in (("msg", "tx"), ("msg",)):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        return len(arguments) == 2
    raise HandlerOptionError(
        f"handler {_name(func)!r} takes {signature}; it must accept the message: "
        "write def handler(msg) or def handler(msg, tx) (other parameters need defaults)"
    )
