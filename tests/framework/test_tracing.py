"""OpenTelemetry through real transports: the producer's span context travels in the message
headers, through the broker server (``reliable://``) and Redis Streams (``redis://``), and the
consumer's span is its child, with the messaging attributes and the outcome; a poison message's
span records its exception. Spans are read from the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import text

from reliable import App
from reliable.otel import TracingMiddleware
from reliable.settings import Settings
from reliable.testing import test_app

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter) -> TracingMiddleware:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return TracingMiddleware(provider)


def spans(exporter, kind: SpanKind, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is kind and s.name == name]


def app_on(url: str, tmp_path: Path, tracing: TracingMiddleware) -> App:
    env = {"RELIABLE_TRANSPORT__URL": url, "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
           "RELIABLE_CACHE__URL": "memory://", "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
           "RELIABLE_LOG__LEVEL": "warning"}
    return App(Settings.load(None, env=env), middleware=[tracing])


@pytest.mark.parametrize("transport", ["reliable", "redis"])
def test_the_consumer_span_is_the_child_of_the_producer_span(transport, request, tmp_path, unique, exporter,
                                                             tracing) -> None:
    url = (request.getfixturevalue("reliable_server").url if transport == "reliable"
           else f"{request.getfixturevalue('redis_url')}?namespace={unique}")
    app = app_on(url, tmp_path, tracing)
    topic, group = unique, f"g-{unique}"

    @app.handler(topic, group=group, token="body.id", fatal=(ValueError,))
    def handle(msg):
        if msg.body["id"] == "bad":
            raise ValueError("amount must be positive")

    app.publish(topic, {"id": "good"})
    app.publish(topic, {"id": "bad"})
    app.run(until_idle=True)
    app.close()

    producers = spans(exporter, SpanKind.PRODUCER, f"send {topic}")
    consumers = spans(exporter, SpanKind.CONSUMER, f"process {topic}")
    assert len(producers) == 2 and len(consumers) == 2
    by_span = {p.context.span_id: p for p in producers}
    for consumer in consumers:
        producer = by_span[consumer.parent.span_id]  # the parent is a producer span...
        assert consumer.context.trace_id == producer.context.trace_id  # ...of the same trace
        assert consumer.parent.is_remote  # extracted from the message headers
        attributes = consumer.attributes
        assert attributes["messaging.system"] == ("reliable" if transport == "reliable" else "redis")
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.consumer.group.name"] == group
        assert attributes["messaging.message.id"]
    assert {p.attributes["messaging.operation.type"] for p in producers} == {"send"}
    outcomes = {c.attributes["reliable.token"]: c for c in consumers}
    assert outcomes["good"].attributes["reliable.outcome"] == "processed"
    assert outcomes["good"].status.status_code is StatusCode.UNSET
    bad = outcomes["bad"]
    assert bad.attributes["reliable.outcome"] == "dead_lettered"
    assert bad.status.status_code is StatusCode.ERROR
    (event,) = [e for e in bad.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "amount must be positive"


@pytest.mark.parametrize("shape", ["sync", "async", "lease"])
def test_a_handler_publishing_continues_the_trace_through_the_outbox(tmp_path, exporter, tracing, shape) -> None:
    """tx.publish inside a handler: its producer span is a child of the consumer span (current
    while the handler runs), so the next handler's span is in the same trace."""
    app = test_app(tmp_path)
    app.add_middleware(tracing)
    options = {"lease": 30.0} if shape == "lease" else {}

    if shape == "async":
        @app.handler("orders", token="body.id")
        async def place(msg, tx):
            tx.publish("invoices", {"order": msg.body["id"]})
    else:
        @app.handler("orders", token="body.id", **options)
        def place(msg, tx):
            tx.publish("invoices", {"order": msg.body["id"]})

    @app.handler("invoices")
    def invoice(msg):
        pass

    app.publish("orders", {"id": "o-1"})
    app.run(until_idle=True)
    app.close()

    (sent,) = spans(exporter, SpanKind.PRODUCER, "send orders")
    (order,) = spans(exporter, SpanKind.CONSUMER, "process orders")
    (created,) = spans(exporter, SpanKind.PRODUCER, "create invoices")
    (invoiced,) = spans(exporter, SpanKind.CONSUMER, "process invoices")
    assert order.parent.span_id == sent.context.span_id
    assert created.parent.span_id == order.context.span_id  # made while the handler ran
    assert created.attributes["messaging.operation.type"] == "create"
    assert invoiced.parent.span_id == created.context.span_id
    assert len({s.context.trace_id for s in (sent, order, created, invoiced)}) == 1
    assert order.attributes["messaging.system"] == "memory"


def test_a_retried_message_records_each_retry(tmp_path, exporter, tracing) -> None:
    app = test_app(tmp_path, settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "2"})
    app.add_middleware(tracing)
    calls = []

    @app.handler("orders", token="body.id", retry_on=(ConnectionError,))
    def place(msg, tx):
        calls.append(msg.attempt)
        if len(calls) <= 2:  # both in-process attempts of the first delivery fail
            raise ConnectionError("database hiccup")
        tx.execute(text("select 1"))

    app.publish("orders", {"id": "o-1"})
    app.run(until_idle=True)
    app.close()

    first, second = sorted(spans(exporter, SpanKind.CONSUMER, "process orders"),
                           key=lambda s: s.attributes["reliable.attempt"])
    assert first.attributes["reliable.outcome"] == "redelivered"
    assert first.status.status_code is StatusCode.ERROR
    exceptions = [e for e in first.events if e.name == "exception"]
    assert len(exceptions) == 2  # the in-process retry, then the error that made it redelivered
    assert exceptions[0].attributes["reliable.retry.attempt"] == 1
    assert second.attributes["reliable.outcome"] == "processed"
    assert second.parent.span_id == first.parent.span_id  # both children of the one producer span


def test_without_the_extra_the_error_names_it() -> None:
    script = ("import sys; sys.modules['opentelemetry'] = None\n"
              "from reliable.otel import TracingMiddleware\n"
              "TracingMiddleware()\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "ExtraNotInstalledError" in run.stderr
    assert "pip install 'reliable[otel]'" in run.stderr
