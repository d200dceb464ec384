"""The built-in middleware: logs, counters and Prometheus metrics, one concern each.

Every app registers them first (`App.middleware`); they are written as any
user's middleware is (`reliable.middleware.Middleware`), so they are the
examples to start from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import structlog

from backends.types import Message
from reliable import metrics
from reliable.handler import Handler
from reliable.log import Counters
from reliable.middleware import Middleware
from reliable.outcome import Outcome, Result

log = structlog.get_logger("reliable.pipeline")


class Logs(Middleware):
    """Logs every failure one by one (redelivered, dead-lettered, deferred) with its traceback,
    and every in-process retry."""

    def on_retry(self, handler: Handler, messages: Sequence[Message], error: BaseException, attempt: int) -> None:
        log.info("retrying_in_process", handler=handler.name, attempt=attempt, error=repr(error), exc_info=error)

    def after_messages(self, handler: Handler, outcomes: Sequence[tuple[Message, Result | None]]) -> None:
        for message, result in outcomes:
            if result is not None and result.outcome in _FAILURE_EVENTS:
                _log_failure(handler, message, result)


def _log_failure(handler: Handler, message: Message, result: Result) -> None:
    level, event = _FAILURE_EVENTS[result.outcome]
    getattr(log, level)(
        event,
        handler=handler.name, group=handler.group, topic=message.topic, queue=message.queue,
        offset=message.offset, token=result.token, attempt=message.attempt, delay=round(result.delay, 3),
        error=repr(result.error), exc_info=result.error,  # the traceback: file and line
    )


_FAILURE_EVENTS = {
    Outcome.REDELIVERED: ("warning", "redelivery_scheduled"),
    Outcome.DEAD_LETTERED: ("error", "dead_lettered"),
    Outcome.DEFERRED: ("warning", "message_deferred"),
}


class Counts(Middleware):
    """The counters of `App.stats()`: one per outcome, and ``retried`` for in-process retries."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def on_retry(self, handler: Handler, messages: Sequence[Message], error: BaseException, attempt: int) -> None:
        self.counters.incr("retried")

    def after_messages(self, handler: Handler, outcomes: Sequence[tuple[Message, Result | None]]) -> None:
        for outcome, n in _tally(outcomes).items():
            self.counters.incr(outcome, n)


class Prometheus(Middleware):
    """The Prometheus metrics of `reliable.metrics`: ``reliable_messages_total{handler, outcome}``
    (``retried`` included) and ``reliable_handler_seconds{handler}``."""

    def on_retry(self, handler: Handler, messages: Sequence[Message], error: BaseException, attempt: int) -> None:
        metrics.messages(handler.name, "retried").inc()

    def after_handler(self, handler: Handler, messages: Sequence[Message], seconds: float,
                      error: BaseException | None) -> None:
        metrics.observe(handler.name, seconds)

    def after_messages(self, handler: Handler, outcomes: Sequence[tuple[Message, Result | None]]) -> None:
        for outcome, n in _tally(outcomes).items():
            metrics.messages(handler.name, outcome).inc(n)


def _tally(outcomes: Sequence[tuple[Message, Result | None]]) -> Counter[str]:
    """How many messages had each outcome (undecided ones are not counted)."""
    return Counter(result.outcome.value for _, result in outcomes if result is not None)


def built_in(counters: Counters) -> list[Middleware]:
    """The middleware every app starts with, outermost first."""
    return [Logs(), Counts(counters), Prometheus()]
