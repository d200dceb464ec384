"""Middleware: hook objects around every message and every publish (dramatiq's middleware).

A middleware subclasses `Middleware` and overrides the hooks it needs; an
app calls every registered one (``App(middleware=[...])``,
``app.add_middleware(...)``). The built-in logs, counters and Prometheus
metrics are middleware too (`reliable.reporting`), registered first.

Order: ``before_*`` hooks run in registration order; ``after_*`` and
``on_*`` hooks (events coming back out) in reverse, so the first middleware
registered is the outermost layer.

A hook that raises is logged (``middleware_failed``, with its traceback) and
the others still run: a middleware can neither lose a message nor mask the
handler's own error, since the pipeline's decision and the worker's ack do
not depend on it. A ``before_publish`` that raises leaves the headers as the
hooks before it made them, and the message is still published.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from backends.types import Message
from reliable.errors import MiddlewareError
from reliable.outcome import Result

if TYPE_CHECKING:
    from reliable.app import App
    from reliable.handler import Handler

log = structlog.get_logger("reliable.middleware")


@dataclass
class Publish:
    """One publish call on its way out: what ``before_publish`` may add headers to.

    ``outbox``: written by ``tx.publish`` as an outbox row, sent by a relay once
    its transaction commits; else sent to the transport now (`App.publish`).
    ``rows``: for a relay's send (``before_relay``), the headers of each outbox row
    sent, which go out as their ``tx.publish`` hooks made them (``headers`` is not sent);
    for a dead-letter replay, the headers the letters were first published with.
    ``replay``: a dead-letter replay sending letters back to their group; ``headers``
    is added to each letter's own headers (a key in both takes ``headers``' value).
    """

    topic: str
    headers: dict[str, str] = field(default_factory=dict)
    count: int = 1  # messages in the call, all carrying ``headers``
    outbox: bool = False
    rows: tuple[Mapping[str, str], ...] = ()
    replay: bool = False


class Middleware:
    """A no-op base: override the hooks you need (each is called from the worker's threads)."""

    def on_open(self, app: App) -> None:
        """The app opened its backends (first use): read what you need of it (settings, transport)."""

    def before_message(self, handler: Handler, message: Message) -> None:
        """``message`` entered ``handler``'s pipeline (before its token and the cache)."""

    def before_handler(self, handler: Handler, messages: Sequence[Message]) -> None:
        """The handler function is about to run on ``messages`` (one, or a batch); once per attempt."""

    def after_handler(self, handler: Handler, messages: Sequence[Message], seconds: float,
                      error: BaseException | None) -> None:
        """The handler function returned (``error`` None) or raised, after ``seconds`` on the app's clock."""

    def on_retry(self, handler: Handler, messages: Sequence[Message], error: BaseException, attempt: int) -> None:
        """A transient ``error`` of attempt ``attempt`` is retried in process."""

    def on_dead_letter(self, handler: Handler, result: Result) -> None:
        """``result.message`` was dead-lettered: its record is in the store, the transport gets POISON."""

    def after_message(self, handler: Handler, message: Message, result: Result | None) -> None:
        """``message``'s outcome was decided (``result``: processed, duplicate, redelivered,
        dead-lettered, deferred), or None: it was not decided (a stopping worker handed it back,
        or the pipeline failed) and comes back unacknowledged."""

    def after_messages(self, handler: Handler, outcomes: Sequence[tuple[Message, Result | None]]) -> None:
        """Every message of one pipeline run with its outcome (as `after_message`), at once.

        Override this instead of `after_message` to handle a fetch together (the built-in
        counters tally it); a middleware that overrides it gets no `after_message` calls."""

    def before_publish(self, publish: Publish) -> None:
        """A publish is about to happen: add to ``publish.headers`` to send more headers."""

    def after_publish(self, publish: Publish, error: BaseException | None) -> None:
        """The transport confirmed the publish (outbox: its row was made), or it raised ``error``."""

    def before_relay(self, publish: Publish) -> None:
        """A relay is about to send committed outbox rows of ``publish.topic`` (``publish.rows``:
        their headers, sent unchanged), once per send call; not a new publish (``tx.publish``
        had its ``before_publish``), so it is not counted twice."""

    def after_relay(self, publish: Publish, error: BaseException | None) -> None:
        """The transport confirmed the relay's send, or it raised ``error`` (the rows are sent again)."""


HOOKS = tuple(name for name in vars(Middleware) if name.startswith(("on_", "before_", "after_")))


class Middlewares:
    """The middleware of an app, and the one place hooks are called (order, failures)."""

    def __init__(self, middleware: Sequence[Middleware] = ()) -> None:
        self._all: list[Middleware] = []
        self._calls: dict[str, tuple[tuple[Middleware, Any], ...]] = {}
        self._outcome_calls: tuple[tuple[Middleware, Any, bool], ...] = ()
        for m in middleware:
            self.add(m)
        self._index()

    def __iter__(self) -> Iterator[Middleware]:
        return iter(list(self._all))

    def __len__(self) -> int:
        return len(self._all)

    def add(self, middleware: Middleware) -> None:
        """Register ``middleware`` after the others (innermost)."""
        if not isinstance(middleware, Middleware):
            raise MiddlewareError(f"{middleware!r} is not a reliable.Middleware (subclass it, override hooks)")
        self._all.append(middleware)
        self._index()

    def _index(self) -> None:
        """Per hook, the middleware that override it, in the order the hook runs."""
        calls = {}
        for hook in HOOKS:
            own = [m for m in self._all if getattr(type(m), hook) is not getattr(Middleware, hook)]
            ordered = own if hook.startswith("before_") else own[::-1]
            calls[hook] = tuple((m, getattr(m, hook)) for m in ordered)
        together = {m for m, _ in calls["after_messages"]}
        self._outcome_calls = tuple(
            (m, m.after_messages, True) if m in together else (m, m.after_message, False)
            for m in self._all[::-1] if m in together or any(m is o for o, _ in calls["after_message"]))
        self._calls = calls  # swapped whole: a hook being called meanwhile sees the old or new

    def overridden(self, hook: str) -> bool:
        """Whether any middleware implements ``hook`` (callers skip work for unused hooks)."""
        return bool(self._calls[hook])

    def emit(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every middleware that has it; one that raises is logged, the rest run."""
        for middleware, call in self._calls[hook]:
            self._guarded(middleware, hook, call, *args)

    @staticmethod
    def _guarded(middleware: Middleware, hook: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:
            log.error("middleware_failed", middleware=type(middleware).__name__, hook=hook,
                      error=repr(exc), exc_info=exc)

    def each(self, hook: str, handler: Handler, messages: Sequence[Message]) -> None:
        """``hook(handler, message)`` for each of ``messages``."""
        if self._calls[hook]:
            for message in messages:
                self.emit(hook, handler, message)

    def outcomes(self, handler: Handler, outcomes: Sequence[tuple[Message, Result | None]]) -> None:
        """Each middleware in turn (reversed) gets the outcomes: in one ``after_messages`` call
        where it overrides that hook, else one ``after_message`` call per message."""
        for middleware, call, together in self._outcome_calls:
            if together:
                self._guarded(middleware, "after_messages", call, handler, outcomes)
            else:
                for message, result in outcomes:
                    self._guarded(middleware, "after_message", call, handler, message, result)

    @contextmanager
    def publishing(self, topic: str, headers: Mapping[str, str] | None, count: int = 1, *,
                   outbox: bool = False, replayed: Sequence[Mapping[str, str]] = ()) -> Iterator[dict[str, str]]:
        """Around one publish call: ``before_publish``, the headers to send, ``after_publish``.

        ``replayed``: the letters' own headers when the call replays dead letters.
        """
        publish = Publish(topic, dict(headers or {}), count, outbox, rows=tuple(replayed), replay=bool(replayed))
        if not self._calls["before_publish"] and not self._calls["after_publish"]:
            yield publish.headers
            return
        self.emit("before_publish", publish)
        try:
            yield publish.headers
        except BaseException as exc:
            self.emit("after_publish", publish, exc)
            raise
        self.emit("after_publish", publish, None)

    @contextmanager
    def relaying(self, topic: str, rows: Sequence[Mapping[str, str]]) -> Iterator[None]:
        """Around one send of outbox rows by a relay (``rows``: their headers): ``before_relay``,
        ``after_relay``."""
        if not self._calls["before_relay"] and not self._calls["after_relay"]:
            yield
            return
        publish = Publish(topic, {}, len(rows), outbox=True, rows=tuple(rows))
        self.emit("before_relay", publish)
        try:
            yield
        except BaseException as exc:
            self.emit("after_relay", publish, exc)
            raise
        self.emit("after_relay", publish, None)

    def outbox_hook(self, topic: str, headers: Mapping[str, str] | None) -> Any:
        """`publishing` for ``tx.publish`` (`backends.store.outbox_writer.PublishHook`)."""
        return self.publishing(topic, headers, outbox=True)
