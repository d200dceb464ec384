"""Observers: the one place each outcome is reported (counters, logs, metrics).

`Observer` is a no-op base with one hook per event (dramatiq's middleware
style); the pipeline calls every observer of its `Observers` list, so a
metrics exporter is one ``observers.append(...)``. `Report` is the built-in
one: counters in `Runtime.counters` and the structured log events.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import structlog

from reliable import metrics
from reliable.handler import Handler
from reliable.log import Counters
from reliable.outcome import Outcome, Result

log = structlog.get_logger("reliable.pipeline")


class Observer:
    """Hooks called by the pipeline; override the ones you need."""

    def outcomes(self, handler: Handler, results: Sequence[Result]) -> None:
        """``results`` were decided (processed, duplicate, redelivered, dead-lettered, deferred)."""

    def retried(self, handler: Handler, error: BaseException, attempt: int) -> None:
        """A transient ``error`` is retried in process (``attempt`` failed)."""

    def handler_ran(self, handler: Handler, messages: int, seconds: float) -> None:
        """The handler function returned or raised after ``seconds`` (on the runtime's clock)."""


class Observers(list[Observer]):
    """The observers of one pipeline, called in order."""

    def outcomes(self, handler: Handler, results: Sequence[Result]) -> None:
        for observer in self:
            observer.outcomes(handler, results)

    def retried(self, handler: Handler, error: BaseException, attempt: int) -> None:
        for observer in self:
            observer.retried(handler, error, attempt)

    def handler_ran(self, handler: Handler, messages: int, seconds: float) -> None:
        for observer in self:
            observer.handler_ran(handler, messages, seconds)


class Report(Observer):
    """Counts every outcome; logs failures one by one and successes as one batch event."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def outcomes(self, handler: Handler, results: Sequence[Result]) -> None:
        tally = Counter(r.outcome for r in results)
        for outcome, count in tally.items():
            self.counters.incr(outcome.value, count)
        for result in results:
            if result.outcome in _FAILURE_EVENTS:
                _log_failure(handler, result)
        log.debug("messages_handled", handler=handler.name, group=handler.group,
                  **{o.value: n for o, n in tally.items()})


class Metrics(Observer):
    """Prometheus metrics (`reliable.metrics`): one counter per outcome, retries, handler latency."""

    def outcomes(self, handler: Handler, results: Sequence[Result]) -> None:
        for outcome, n in Counter(r.outcome for r in results).items():
            metrics.count(handler.name, outcome.value, n)

    def retried(self, handler: Handler, error: BaseException, attempt: int) -> None:
        metrics.count(handler.name, "retried")

    def handler_ran(self, handler: Handler, messages: int, seconds: float) -> None:
        metrics.observe(handler.name, seconds)


def _log_failure(handler: Handler, result: Result) -> None:
    m = result.message
    level, event = _FAILURE_EVENTS[result.outcome]
    getattr(log, level)(
        event,
        handler=handler.name, group=handler.group, topic=m.topic, queue=m.queue,
        offset=m.offset, token=result.token, attempt=m.attempt, delay=round(result.delay, 3),
        error=repr(result.error), exc_info=result.error,  # the traceback: file and line
    )


_FAILURE_EVENTS = {
    Outcome.REDELIVERED: ("warning", "redelivery_scheduled"),
    Outcome.DEAD_LETTERED: ("error", "dead_lettered"),
    Outcome.DEFERRED: ("warning", "message_deferred"),
}
