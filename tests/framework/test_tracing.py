"""OpenTelemetry through real transports: the producer's span context travels in the message
headers, through the broker server (``reliable://``) and Redis Streams (``redis://``), and the
consumer's span is its child, with the messaging attributes and the outcome; a poison message's
span records its exception. A batch handler's call has a span linked to its messages' producer
spans; a relay's send of outbox rows has a span linked to the rows' ``create`` spans. Spans are
read from the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace
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
    expected = "reliable" if transport == "reliable" else "redis"  # the first publish too: it opened the app
    assert {p.attributes["messaging.system"] for p in producers} == {expected}
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
    (relayed,) = spans(exporter, SpanKind.PRODUCER, "send invoices")
    assert order.parent.span_id == sent.context.span_id
    assert [link.context.span_id for link in relayed.links] == [created.context.span_id]
    assert created.parent.span_id == order.context.span_id  # made while the handler ran
    assert created.attributes["messaging.operation.type"] == "create"
    assert invoiced.parent.span_id == created.context.span_id
    assert len({s.context.trace_id for s in (sent, order, created, invoiced)}) == 1
    assert order.attributes["messaging.system"] == "memory"


def url_of(transport: str, request, unique: str) -> str:
    return (request.getfixturevalue("reliable_server").url if transport == "reliable"
            else f"{request.getfixturevalue('redis_url')}?namespace={unique}")


@pytest.mark.parametrize("transport", ["reliable", "redis"])
def test_a_batch_handler_runs_under_a_batch_span_linked_to_each_producer(transport, request, tmp_path, unique,
                                                                         exporter, tracing) -> None:
    app = app_on(url_of(transport, request, unique), tmp_path, tracing)
    topic, group = unique, f"g-{unique}"
    calls: list[tuple[int, list[str]]] = []  # (the span current in the call, the messages' ids)

    @app.handler(topic, group=group, token="body.id", batch=10, fatal=(ValueError,))
    def handle(messages, tx):
        calls.append((trace.get_current_span().get_span_context().span_id, [m.id for m in messages]))
        if any(m.body["id"] == "bad" for m in messages):
            raise ValueError("amount must be positive")
        for m in messages:
            tx.publish(f"{topic}-done", {"id": m.body["id"]})

    app.publish_many(topic, [{"id": f"o-{n}"} for n in range(4)])
    app.run(until_idle=True)
    app.publish(topic, {"id": "bad"})
    app.run(until_idle=True)
    app.close()

    (sent,) = [s for s in spans(exporter, SpanKind.PRODUCER, f"send {topic}")
               if s.attributes.get("messaging.batch.message_count") == 4]
    processed = [s for s in spans(exporter, SpanKind.CONSUMER, f"process {topic}")
                 if "messaging.message.id" in s.attributes]
    batches = {s.context.span_id: s for s in spans(exporter, SpanKind.CONSUMER, f"process {topic}")
               if "messaging.message.id" not in s.attributes}
    good = [(span_id, ids) for span_id, ids in calls if len(ids) > 1]
    assert good, f"the four messages never came in one batch: {calls}"
    for span_id, ids in calls:
        batch = batches[span_id]  # the batch span was the current one in the call
        parents = {s.parent.span_id for s in processed if s.attributes["messaging.message.id"] in ids}
        assert {link.context.span_id for link in batch.links} == parents  # one link per producer context
        assert all(link.context.trace_id == sent.context.trace_id or len(ids) == 1 for link in batch.links)
        assert batch.parent is None  # its own trace: its messages come from many
        assert batch.attributes.get("messaging.batch.message_count", 1) == len(ids)
        assert batch.attributes["messaging.operation.type"] == "process"
        assert batch.attributes["messaging.consumer.group.name"] == group
        assert "reliable.outcome" not in batch.attributes  # outcomes are per message
    failed = [batches[span_id] for span_id, ids in calls if ids == calls[-1][1]]
    assert len(failed) == 2  # the batch call, then the message alone (a batch that fails is split)
    for span in failed:
        assert span.status.status_code is StatusCode.ERROR
        assert [e.attributes["exception.type"] for e in span.events] == ["ValueError"]
    outcomes = {s.attributes["reliable.token"]: s.attributes["reliable.outcome"] for s in processed}
    assert outcomes == {**{f"o-{n}": "processed" for n in range(4)}, "bad": "dead_lettered"}
    created = spans(exporter, SpanKind.PRODUCER, f"create {topic}-done")
    assert len(created) == 4
    assert {c.parent.span_id for c in created} <= {span_id for span_id, ids in good}  # made in the batch call
    done = spans(exporter, SpanKind.CONSUMER, f"process {topic}-done")
    assert done == []  # no handler consumes them: only the relay's send


@pytest.mark.parametrize("transport", ["reliable", "redis"])
def test_the_relay_send_is_linked_to_the_create_spans(transport, request, tmp_path, unique, exporter,
                                                      tracing) -> None:
    """Rows of two transactions, sent by the relay in one call: its send span links both create
    spans, and each consumer is still the child of its own create span (the row's traceparent)."""
    app = app_on(url_of(transport, request, unique), tmp_path, tracing)
    topic = unique

    @app.handler(topic, group=f"g-{unique}", token="body.id")
    def handle(msg):
        pass

    for order in ("o-1", "o-2"):
        with app.store.transaction() as tx:
            tx.publish(topic, {"id": order})
    app.run(until_idle=True)
    app.close()

    created = spans(exporter, SpanKind.PRODUCER, f"create {topic}")
    sends = spans(exporter, SpanKind.PRODUCER, f"send {topic}")
    consumers = spans(exporter, SpanKind.CONSUMER, f"process {topic}")
    assert len(created) == 2 and len(consumers) == 2
    assert {c.parent.span_id for c in consumers} == {c.context.span_id for c in created}
    linked = {link.context.span_id: link.context.trace_id for send in sends for link in send.links}
    assert linked == {c.context.span_id: c.context.trace_id for c in created}
    assert sum(send.attributes.get("messaging.batch.message_count", 1) for send in sends) == 2
    for send in sends:
        assert send.attributes["messaging.operation.type"] == "send"
        assert send.attributes["messaging.destination.name"] == topic
        assert send.status.status_code is StatusCode.UNSET
        assert not ({send.context.span_id} & {c.parent.span_id for c in consumers})  # not the parent


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


def test_a_replayed_dead_letter_is_sent_under_a_replay_span(tmp_path, unique, exporter, tracing) -> None:
    """A replay is a send of its own: its span links the letter's first producer span, and the
    replayed attempt is its child (the replay's context replaced the old ``traceparent``)."""
    app = test_app(tmp_path, settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    app.add_middleware(tracing)
    broken = [True]

    @app.handler("orders", group="billing", token="body.id", fatal=(ValueError,))
    def bill(msg):
        if broken[0]:
            raise ValueError("no tariff")

    app.publish("orders", {"id": "o-1"})
    app.run(until_idle=True)
    broken[0] = False
    assert app.replay_dead_letters("billing") == 1
    app.run(until_idle=True)
    app.close()

    first, replay = sorted(spans(exporter, SpanKind.PRODUCER, "send orders"), key=lambda s: s.start_time)
    failed, processed = sorted((s for s in exporter.get_finished_spans() if s.kind is SpanKind.CONSUMER),
                               key=lambda s: s.start_time)  # the replay comes from the group's %RETRY% queue
    assert failed.attributes["reliable.outcome"] == "dead_lettered" and failed.parent.span_id == first.context.span_id
    assert replay.attributes["reliable.replay"] is True and "reliable.replay" not in first.attributes
    assert [link.context.span_id for link in replay.links] == [first.context.span_id]
    assert processed.attributes["reliable.outcome"] == "processed"
    assert processed.parent.span_id == replay.context.span_id


def test_without_the_extra_the_error_names_it() -> None:
    script = ("import sys; sys.modules['opentelemetry'] = None\n"
              "from reliable.otel import TracingMiddleware\n"
              "TracingMiddleware()\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "ExtraNotInstalledError" in run.stderr
    assert "pip install 'reliable[otel]'" in run.stderr
