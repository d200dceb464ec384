"""The web console from the framework's side: its dead letters, and ``reliable console``.

The console itself is the broker's (`broker.console`); the framework plugs in
the one place its users keep dead letters, the store (`StoreLetters`), and
serves the console for a deployment on the embedded broker or any other
transport (`serve`). On a broker transport the console also shows topics,
groups, lag and the broker's ``%DLQ%``; on another transport only the store's
dead letters.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence

import structlog
from prometheus_client.parser import text_string_to_metric_families

from backends.transport.broker import BrokerTransport
from backends.types import DeadLetter, readable
from broker.console import render
from broker.console.config import ConsoleConfig
from broker.console.serving import ConsoleServer, start_console
from broker.console.sources import BrokerView, ConsoleActionError, Letter, broker_view
from broker.server.auth import Authenticator
from reliable.app import App
from reliable.deadletter import DeadLetters
from reliable.errors import ReliableError

log = structlog.get_logger("reliable.console")


class StoreLetters:
    """The framework's dead-letter records (the store) as the console's `LetterBook`."""

    def __init__(self, app: App, max_replays: int = 3) -> None:
        self.app = app
        self.max_replays = max_replays

    @property
    def letters(self) -> DeadLetters:
        """The app's dead-letter queue (its backends open on the first page that needs them)."""
        return self.app.dead_letter_queue

    def groups(self) -> list[str]:
        return self.letters.store.dead_letter_groups()

    def count(self, group: str) -> int:
        return self.letters.count(group)

    def page(self, group: str, limit: int, after_id: int) -> list[Letter]:
        # a listing shows a line of each body: the store reads no more of it (a page of 100 MiB
        # bodies held them all in memory at once)
        return [_letter(d) for d in self.letters.page(group, limit, after_id, body_limit=render.PREVIEW_READS)]

    def get(self, letter_id: int) -> Letter | None:
        found = self.letters.get(letter_id)
        return None if found is None else _letter(found)

    def replay(self, group: str, ids: Sequence[int], *, force: bool) -> int:
        """Replay to the failing group only, refusing letters replayed ``max_replays`` times unless forced."""
        try:
            return self.letters.replay(group, list(ids), max_replays=self.max_replays, force=force)
        except ReliableError as exc:
            raise ConsoleActionError(str(exc)) from exc

    def purge(self, group: str, ids: Sequence[int]) -> int:
        try:
            return self.letters.purge(group, list(ids))
        except ReliableError as exc:
            raise ConsoleActionError(str(exc)) from exc


def _letter(letter: DeadLetter) -> Letter:
    m, f = letter.message, letter.failure
    return Letter(id=letter.id or 0, group=letter.group, topic=m.topic or "", message_id=m.id, key=readable(m.key or ""),
                  headers={name: readable(value) for name, value in m.headers.items()}, body=m.payload, body_size=letter.body_size, error_type=f.error_type, error=f.error_message,
                  traceback=f.traceback, attempts=f.attempts, replays=letter.replays,
                  last_failure_at=f.last_failure_at, extra={"token": letter.token or ""})


class OutboxBacklog:
    """The app's outbox backlog (`reliable outbox status`) as the console's `Backlog`."""

    def __init__(self, app: App) -> None:
        self.app = app

    def status(self) -> dict[str, float | int | str | None]:
        status = self.app.store.outbox.status()
        return {"outbox": status.outbox, "pending": status.backlog, "failed": status.failed, "sent": status.sent,
                "oldest unsent, seconds": round(status.oldest_unsent_age(self.app.clock.time()), 3)}


class WorkerCounters:
    """The handlers' message counters (``reliable_messages_total``), read from workers' ``/metrics``.

    The counters live in the worker processes (``reliable run --metrics-port``);
    the console reads them at each page view, with a short timeout per worker,
    and lists a worker that does not answer with no counts.
    """

    def __init__(self, urls: Sequence[str], timeout: float = 2.0) -> None:
        self.urls, self.timeout = list(urls), timeout

    def table(self) -> list[tuple[str, str, dict[str, float]]]:
        rows: list[tuple[str, str, dict[str, float]]] = []
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as response:  # noqa: S310 (operator's URL)
                    text = response.read().decode()
            except (OSError, ValueError) as exc:
                log.warning("console.metrics_unreachable", url=url, error=str(exc))
                rows.append((url, "(no answer)", {}))
                continue
            counts: dict[str, dict[str, float]] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "reliable_messages_total":
                        handler, outcome = sample.labels.get("handler", ""), sample.labels.get("outcome", "")
                        counts.setdefault(handler, {})[outcome] = sample.value
            rows.extend((url, handler, outcomes) for handler, outcomes in sorted(counts.items()))
        return rows


def app_view(app: App) -> BrokerView | None:
    """The broker behind ``app``'s transport, when it is the project's broker (embedded or a server)."""
    transport = app.transport
    return broker_view(transport.api) if isinstance(transport, BrokerTransport) else None


def serve(app: App, config: ConsoleConfig, authenticator: Authenticator,
          metrics: Sequence[str] = ()) -> ConsoleServer:
    """Serve the console for ``app``'s settings: its store's dead letters and outbox, its broker if
    it has one, and the counters of the workers whose ``/metrics`` URLs are given; sessions age
    by the app's clock."""
    return start_console(config, authenticator, app_view(app), StoreLetters(app), OutboxBacklog(app),
                         WorkerCounters(metrics) if metrics else None, clock=app.clock)
