"""Tracing with OpenTelemetry, as a middleware: ``App(middleware=[TracingMiddleware()])``.

* a PRODUCER span per publish (``send <topic>`` for `App.publish` /
  ``publish_many``; ``create <topic>`` for ``tx.publish``, whose outbox row a
  relay sends once the transaction commits), whose context is injected into
  the message headers (W3C ``traceparent``: it travels on every transport,
  since headers do);
* a PRODUCER span per send of outbox rows by a relay (``send <topic>``), with
  a link to the ``create`` span of each row it sends; the rows' headers are
  sent unchanged, so their consumers stay children of the ``create`` spans;
* a PRODUCER span per dead-letter replay (``send <topic>``, ``reliable.replay``),
  linked to each letter's first producer span; the replayed messages carry its
  context, so the new attempts are its children;
* a CONSUMER span per message (``process <topic>``), the child of the
  producer's span extracted from those headers, with the OpenTelemetry
  messaging attributes and the outcome (``reliable.outcome``: processed,
  duplicate, redelivered, dead_lettered, deferred); in-process retries are
  recorded as exceptions on it, and the final error of a failed message too;
* a CONSUMER span per call of a batch handler (``process <topic>``, with
  ``messaging.batch.message_count``), linked to each message's producer
  span; the outcomes stay on the messages' own spans.

While the handler runs on one message its span is the current one, so the
handler's own spans and its ``tx.publish`` spans are its children; a batch
handler's are the children of the batch span. Only the OpenTelemetry API is
used: the application configures the SDK and exporter. Needs the extra:
``pip install 'reliable[otel]'``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from backends.types import Message, readable
from reliable.errors import ExtraNotInstalledError
from reliable.middleware import Middleware, Publish
from reliable.outcome import Outcome, Result

try:
    from opentelemetry import context, propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError as missing:  # the extra is not installed: said when the middleware is made
    _MISSING: ImportError | None = missing
else:
    _MISSING = None

if TYPE_CHECKING:
    from reliable.app import App
    from reliable.handler import Handler

SYSTEMS = {"embedded": "reliable", "reliable": "reliable", "redis": "redis", "rediss": "redis",
           "amqp": "rabbitmq", "amqps": "rabbitmq", "nats": "nats", "kafka": "kafka", "memory": "memory"}
"""``messaging.system`` per transport URL scheme (OpenTelemetry's names where it has one)."""

FAILED = (Outcome.REDELIVERED, Outcome.DEAD_LETTERED, Outcome.DEFERRED)
"""Outcomes whose span gets status ERROR, with the message's error recorded."""


def _version() -> str:
    try:
        return version("reliable")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0"


class TracingMiddleware(Middleware):
    """Producer and consumer spans for every publish and message (see the module's docstring).

    ``tracer_provider``: where spans go (default: OpenTelemetry's global one).
    ``system``: ``messaging.system`` (default: from the app's transport URL).
    """

    def __init__(self, tracer_provider: Any = None, *, system: str | None = None) -> None:
        if _MISSING is not None:
            raise ExtraNotInstalledError(
                f"reliable.otel.TracingMiddleware needs OpenTelemetry ({_MISSING}): "
                "pip install 'reliable[otel]'") from _MISSING
        self.tracer = trace.get_tracer("reliable", _version(), tracer_provider=tracer_provider)
        self.system = system or "reliable"
        self._fixed_system = system is not None
        self._spans: dict[int, Any] = {}  # id(message or publish) -> its open span
        self._current: dict[int, Any] = {}  # id(messages of a handler call) -> the context token

    def on_open(self, app: App) -> None:
        if not self._fixed_system:
            scheme = urlsplit(app.settings.transport.url).scheme
            self.system = SYSTEMS.get(scheme, scheme)

    # -- consuming ------------------------------------------------------------------------

    def before_message(self, handler: Handler, message: Message) -> None:
        parent = propagate.extract(dict(message.headers))
        attributes: dict[str, Any] = {
            "messaging.system": self.system,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": message.topic,
            "messaging.destination.partition.id": str(message.queue),
            "messaging.message.id": message.id,
            "messaging.consumer.group.name": handler.group,
            "reliable.handler": handler.name,
            "reliable.attempt": message.attempt,
        }
        if message.key is not None:
            attributes["messaging.message.conversation_id"] = readable(message.key)  # exporters send UTF-8
        self._spans[id(message)] = self.tracer.start_span(
            f"process {message.topic}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes)

    def before_handler(self, handler: Handler, messages: Sequence[Message]) -> None:
        if handler.batch:
            span = self._batch_span(handler, messages)
            self._spans[id(messages)] = span
        else:
            span = self._spans.get(id(messages[0]))
        if span is not None:
            self._current[id(messages)] = context.attach(trace.set_span_in_context(span))

    def _batch_span(self, handler: Handler, messages: Sequence[Message]) -> Any:
        """The span of one call of a batch handler: linked to each message's producer context
        (OpenTelemetry's batch receive/process); per-message attributes and outcomes are left
        to the messages' own spans."""
        links = [Link(parent) for parent in (trace.get_current_span(propagate.extract(dict(m.headers)))
                                             .get_span_context() for m in messages) if parent.is_valid]
        attributes: dict[str, Any] = {
            "messaging.system": self.system,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": handler.topic,
            "messaging.consumer.group.name": handler.group,
            "reliable.handler": handler.name,
        }
        if len(messages) != 1:  # the conventions: not on an operation on one message
            attributes["messaging.batch.message_count"] = len(messages)
        return self.tracer.start_span(f"process {handler.topic}", kind=SpanKind.CONSUMER,
                                      attributes=attributes, links=links)

    def after_handler(self, handler: Handler, messages: Sequence[Message], seconds: float,
                      error: BaseException | None) -> None:
        token = self._current.pop(id(messages), None)
        if token is not None:
            context.detach(token)
        span = self._spans.pop(id(messages), None) if handler.batch else None
        if span is not None:
            if error is not None:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, repr(error)))
            span.end()

    def on_retry(self, handler: Handler, messages: Sequence[Message], error: BaseException, attempt: int) -> None:
        for message in messages:
            span = self._spans.get(id(message))
            if span is not None:
                span.record_exception(error, attributes={"reliable.retry.attempt": attempt})

    def after_message(self, handler: Handler, message: Message, result: Result | None) -> None:
        span = self._spans.pop(id(message), None)
        if span is None:
            return
        if result is None:
            span.set_attribute("reliable.outcome", "handed_back")
        else:
            span.set_attribute("reliable.outcome", result.outcome.value)
            if result.token is not None:
                span.set_attribute("reliable.token", result.token)
            if result.outcome in FAILED:
                if result.error is not None:
                    span.record_exception(result.error)
                span.set_status(Status(StatusCode.ERROR, repr(result.error) if result.error else result.outcome.value))
        span.end()

    # -- producing ------------------------------------------------------------------------

    def before_publish(self, publish: Publish) -> None:
        operation = "create" if publish.outbox else "send"
        attributes: dict[str, Any] = {
            "messaging.system": self.system,
            "messaging.operation.type": operation,
            "messaging.operation.name": "publish" if publish.outbox else "send",
            "messaging.destination.name": publish.topic,
        }
        if publish.count != 1:
            attributes["messaging.batch.message_count"] = publish.count
        if publish.replay:
            attributes["reliable.replay"] = True
        span = self.tracer.start_span(f"{operation} {publish.topic}", kind=SpanKind.PRODUCER,
                                      attributes=attributes, links=_links(publish.rows))
        propagate.inject(publish.headers, context=trace.set_span_in_context(span))
        self._spans[id(publish)] = span

    def after_publish(self, publish: Publish, error: BaseException | None) -> None:
        span = self._spans.pop(id(publish), None)
        if span is None:
            return
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, repr(error)))
        span.end()

    def before_relay(self, publish: Publish) -> None:
        attributes: dict[str, Any] = {
            "messaging.system": self.system,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": publish.topic,
        }
        if publish.count != 1:
            attributes["messaging.batch.message_count"] = publish.count
        self._spans[id(publish)] = self.tracer.start_span(
            f"send {publish.topic}", kind=SpanKind.PRODUCER, attributes=attributes, links=_links(publish.rows))

    def after_relay(self, publish: Publish, error: BaseException | None) -> None:
        self.after_publish(publish, error)


def _links(headers: Sequence[Mapping[str, str]]) -> list[Link]:
    """A link to the span each message was first produced in (its ``traceparent``), where it has one."""
    contexts = (trace.get_current_span(propagate.extract(dict(h))).get_span_context() for h in headers)
    return [Link(context) for context in contexts if context.is_valid]
