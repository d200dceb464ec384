"""Prometheus metrics of a worker: what each handler did, and how long it took.

``reliable run --metrics-port 9100`` (or `serve_metrics`) serves them on
``/metrics``. Names follow DESIGN.md's vocabulary:

* ``reliable_messages_total{handler, outcome}``: outcome ``processed``,
  ``duplicate``, ``redelivered``, ``dead_lettered``, ``deferred``, and
  ``retried`` for in-process retries;
* ``reliable_handler_seconds{handler}``: the pipeline's time per message
  (per batch in batch mode), the handler's own call included;
* ``reliable_outbox_backlog{outbox}`` and
  ``reliable_outbox_oldest_unsent_seconds{outbox}``: the rows a relay has still
  to send (FAILED ones included in the age), refreshed by every running relay;
  ``reliable_outbox_rows_total{outbox, state}``: rows a relay marked ``sent``
  or ``failed``;
* ``reliable_store_writes_refused``: 1 while the store's disk refuses writes
  (a full disk: every message is deferred, ``/readyz`` says not ready), else 0;
  read from the store when scraped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

MESSAGES = Counter("reliable_messages", "Messages by handler and outcome", ["handler", "outcome"])
HANDLER_SECONDS = Histogram("reliable_handler_seconds", "Pipeline seconds per message (batch)",
                            ["handler"])
CONSUMER_LAG = Gauge("reliable_consumer_lag", "Messages left for a handler's group on its topic "
                     "(where the transport can tell)", ["handler", "topic"])
OUTBOX_BACKLOG = Gauge("reliable_outbox_backlog", "Outbox rows waiting for a relay", ["outbox"])
OUTBOX_OLDEST = Gauge("reliable_outbox_oldest_unsent_seconds", "Age of the oldest unsent outbox row",
                      ["outbox"])
OUTBOX_ROWS = Counter("reliable_outbox_rows", "Outbox rows a relay marked sent or failed", ["outbox", "state"])
STORE_WRITES_REFUSED = Gauge("reliable_store_writes_refused", "1 while the store's disk refuses writes "
                             "(a full disk: every message is deferred), else 0")


def count(handler: str, outcome: str, n: int = 1) -> None:
    messages(handler, outcome).inc(n)


@functools.cache
def messages(handler: str, outcome: str) -> Any:
    """The ``reliable_messages_total`` child of ``handler`` and ``outcome`` (looked up once)."""
    return MESSAGES.labels(handler, outcome)


def observe(handler: str, seconds: float) -> None:
    HANDLER_SECONDS.labels(handler).observe(seconds)


def consumer_lag(handler: str, topic: str, pending: int) -> None:
    CONSUMER_LAG.labels(handler, topic).set(pending)


def serve_metrics(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> int:
    """Serve ``/metrics`` on ``host:port`` from a background thread; the port bound (0: any)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def outbox_backlog(outbox: str, backlog: int, oldest_unsent_seconds: float) -> None:
    OUTBOX_BACKLOG.labels(outbox).set(backlog)
    OUTBOX_OLDEST.labels(outbox).set(oldest_unsent_seconds)


def outbox_rows(outbox: str, state: str, n: int) -> None:
    if n:
        OUTBOX_ROWS.labels(outbox, state).inc(n)


def watch_store(refusal: Callable[[], str | None]) -> None:
    """``reliable_store_writes_refused`` follows ``refusal`` (`Store.write_refusal`), read when scraped."""
    STORE_WRITES_REFUSED.set_function(lambda: 0.0 if refusal() is None else 1.0)
