"""`App`: the registry of handlers, the backends they share, and the run loop.

``App()`` runs on embedded defaults (durable broker in process under
``./.reliable/``, SQLite store, in-memory cache); ``App.from_settings(path)``
reads a settings file. Backends open lazily, on first use, so a module can
create its app at import time and a command line can still choose settings.
"""

from __future__ import annotations

import difflib
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import structlog

from backends.cache import open_cache
from backends.cache.base import Cache
from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import BackendUnavailableError
from backends.store import open_store
from backends.store.base import Store
from backends.transport import open_transport
from backends.transport.base import Transport
from backends.types import JSON, DeadLetter, OutgoingMessage, encode_body, new_message_id
from backends.urls import redact
from reliable import metrics
from reliable.commit import CommitStrategy, commit_strategy
from reliable.deadletter import DeadLetters
from reliable.errors import HandlerOptionError, StoreUnavailableError, UnknownHandlerError
from reliable.handler import Handler, HandlerConfig
from reliable.health import RunState
from reliable.log import Counters, configure_logging
from reliable.message import CONTENT_TYPE
from reliable.middleware import Middleware, Middlewares
from reliable.outage import through_outages
from reliable.outbox import Relay, checked_publish
from reliable.reporting import built_in
from reliable.retry import Backoff
from reliable.runtime import Runtime
from reliable.settings import Settings
from reliable.settings_errors import SettingsConflictError, changed_keys
from reliable.shutdown import install_signals
from reliable.worker import Worker

log = structlog.get_logger("reliable.app")


OPTIMIZE_ACK_FRACTION = 0.65
"""The batch commit strategy acks once this fraction of the prefetch is pending (ActiveMQ)."""

PURGE_INTERVAL = 3600.0
"""Seconds between purges of expired token records by a running worker."""


class App:
    """Handlers and the backends they run on."""

    def __init__(self, settings: Settings | None = None, *, clock: Clock = SYSTEM_CLOCK, runtime: Runtime | None = None,
                 middleware: Sequence[Middleware] = ()) -> None:
        self.settings = settings if settings is not None else Settings.load(None)
        self.clock = clock
        self.handlers: dict[str, Handler] = {}
        self.counters = runtime.counters if runtime is not None else Counters()
        self.middleware = Middlewares([*built_in(self.counters), *middleware])
        """Hooks around every message and publish (`reliable.middleware`): the built-in logs,
        counters and Prometheus metrics first, then the app's own, in the order given."""
        self._runtime = runtime
        if runtime is not None:
            self._opened(runtime)
        self._stop = threading.Event()
        self._purged_at = float("-inf")
        self._declared: set[str] = set()  # topics whose groups are declared to the transport
        self._lock = threading.Lock()
        self.run_state = RunState(clock)  # what the health probes ask (`reliable.health`)

    @classmethod
    def from_settings(cls, path: str | Path, **kwargs: Any) -> App:
        """An app configured by the settings file at ``path``."""
        return cls(Settings.load(path), **kwargs)

    def use_settings(self, settings: Settings) -> None:
        """Replace the settings before the backends open (the CLI's ``--settings``). Once they are
        open, settings equal to theirs are accepted and others raise `SettingsConflictError`."""
        if self._runtime is None:
            self.settings = settings
        elif changed := changed_keys(self.settings.model_dump(mode="json"), settings.model_dump(mode="json")):
            raise SettingsConflictError(changed)

    # -- registration ---------------------------------------------------------

    def handler(self, topic: str, **options: Any) -> Callable[[Callable[..., Any]], Handler]:
        """Register the decorated function as the handler of ``topic`` (see `Handler`)."""
        if callable(topic):  # ``@app.handler`` without its arguments: the function came as the topic
            name = getattr(topic, "__name__", "handler")
            raise HandlerOptionError(
                f"@app.handler needs the topic: write @app.handler(\"TOPIC\", ...) above def {name}")

        def register(func: Callable[..., Any]) -> Handler:
            handler = Handler(func, topic, **options)
            if handler.name in self.handlers:
                raise HandlerOptionError(f"a handler named {handler.name!r} is already registered; pass name=")
            self.handlers[handler.name] = handler
            return handler

        return register

    def add_middleware(self, middleware: Middleware) -> None:
        """Register ``middleware`` after the others (`reliable.Middleware`); workers and
        publishers already running see it too."""
        self.middleware.add(middleware)
        if self._runtime is not None:
            middleware.on_open(self)

    # -- backends -------------------------------------------------------------

    @property
    def runtime(self) -> Runtime:
        """The opened backends (opened on first use)."""
        with self._lock:
            if self._runtime is None:
                s = self.settings
                if not structlog.is_configured():  # leave an application's own logging alone
                    configure_logging(s.log.level, s.log.format)
                store = open_store(s.store.url, self.clock, outbox=s.outbox.name)
                cache = None if s.cache.url == "none" else open_cache(s.cache.url, self.clock, s.cache.prefix)
                transport = open_transport(s.transport.url, self.clock, **s.transport.options())
                self._runtime = Runtime(transport=transport, store=store, cache=cache, clock=self.clock,
                                        counters=self.counters)
                log.info("backends_opened", transport=redact(s.transport.url), store=redact(s.store.url),
                         cache=redact(s.cache.url))
                self._opened(self._runtime)
            return self._runtime

    def _opened(self, runtime: Runtime) -> None:
        """Route the store's ``tx.publish`` calls through the middleware, watch its disk
        (`metrics.watch_store`), and tell the middleware the app is open."""
        runtime.store.hook_publish(checked_publish(runtime.transport, self.middleware.outbox_hook))
        metrics.watch_store(runtime.store.write_refusal)
        self.middleware.emit("on_open", self)

    @property
    def store(self) -> Store:
        return self.runtime.store

    @property
    def cache(self) -> Cache | None:
        return self.runtime.cache

    @property
    def transport(self) -> Transport:
        return self.runtime.transport

    def stats(self) -> dict[str, int]:
        """Counters: processed, duplicate, retried, redelivered, dead_lettered, deferred, cache_degraded."""
        return self.runtime.counters.snapshot()

    # -- producing ------------------------------------------------------------

    def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float = 0.0,
        message_id: str | None = None,
        content_type: str = JSON,
    ) -> None:
        """Publish one message; ``body`` is encoded (JSON by default) unless it is bytes."""
        self.publish_many(topic, [body], key=key, headers=headers, delay=delay, message_ids=[message_id], content_type=content_type)

    def publish_many(
        self,
        topic: str,
        bodies: Iterable[Any],
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float = 0.0,
        message_ids: Sequence[str | None] | None = None,
        content_type: str = JSON,
    ) -> None:
        """Publish many messages in one call to the transport.

        An outage (`BackendUnavailableError`: unreachable, or a cluster electing a
        leader) is retried for up to ``[transport] publish_timeout`` seconds, then raised.
        """
        bodies = list(bodies)
        # named once, before the first try: a retry after a lost reply is the same message again
        ids = [i or new_message_id() for i in (message_ids or [None] * len(bodies))]
        doing = f"publish to {topic!r}"
        # open the backends first, so that every middleware's on_open ran before its before_publish
        through_outages(lambda _: self.runtime, self.clock, self.settings.transport.publish_timeout, doing)
        with self.middleware.publishing(topic, headers, len(bodies)) as sent_headers:
            all_headers = {CONTENT_TYPE: content_type, **sent_headers}
            outgoing = [
                OutgoingMessage(encode_body(b, content_type), key=key, headers=all_headers, delay=delay, message_id=i)
                for b, i in zip(bodies, ids, strict=True)
            ]

            def send(timeout: float) -> None:
                self._declare_groups(topic)
                self.runtime.transport.publish(topic, outgoing, timeout=timeout)

            through_outages(send, self.clock, self.settings.transport.publish_timeout, doing)

    def relay(self) -> Relay:
        """A relay of this app's outbox to its transport (`reliable.outbox`)."""
        return Relay(self.runtime.store, self.runtime.transport, self.settings.outbox, self.clock,
                     declare=self._declare_groups, hook=self.middleware.relaying)

    def _declare_groups(self, topic: str) -> None:
        """Declare this app's groups on ``topic`` before its first publish there, so a queue
        broker keeps the message for them even before their workers join."""
        if topic in self._declared:
            return
        transport = self.runtime.transport
        for group in sorted({h.group for h in self.handlers.values() if h.topic == topic}):
            transport.declare(group, [topic])
        self._declared.add(topic)

    # -- consuming ------------------------------------------------------------

    def run(self, *, until_idle: bool = False, handlers: Sequence[str] | None = None) -> None:
        """Consume until stopped (SIGINT/SIGTERM or `stop()`), or with ``until_idle`` until
        nothing is left to deliver, scheduled redeliveries and the outbox included.

        With ``outbox.relay`` (the default) the outbox is relayed too: on a thread
        of its own, or with ``until_idle`` between deliveries until it is drained.
        """
        selected = self._select(handlers)
        self._stop.clear()
        if not self._open_waiting():
            return
        workers = [self._worker(h) for h in selected]
        self._warn_unused_handler_settings()
        relay = self.relay() if self.settings.outbox.relay else None
        relaying: AbstractContextManager[object] = (
            relay.running(self._stop) if relay is not None and not until_idle else nullcontext())
        restore = install_signals(self._stop, lambda: sum(w.in_hand for w in workers))
        self._purged_at = self.clock.monotonic()  # first purge one interval in: starting stays fast
        log.info("worker_started", handlers=[w.handler.name for w in workers], until_idle=until_idle)
        self.run_state.began(workers)
        announced: float | None = None  # the scheduled redelivery ``until_idle`` last said it waits for
        try:
            with relaying:
                while not self._stop.is_set():
                    self.run_state.beat()
                    self._purge_expired_tokens()
                    if self._cycle(workers, until_idle):
                        continue
                    if until_idle and relay is not None and relay.drain(self._stop):  # sent: B may have work
                        continue
                    if until_idle:
                        waiting, announced = self._wait_for_due(workers, announced)
                        if not waiting:
                            break
        finally:
            self.run_state.ended()
            for w in workers:
                w.close()
            restore()
            log.info("worker_stopped", **self.stats())

    def _open_waiting(self) -> bool:
        """Open the backends, waiting out an outage (``nats://`` connects as it opens); False once stopped."""
        waits = Backoff(self.clock)  # 0.1 s doubling to 5 s, as a worker reconnects
        while not self._stop.is_set():
            try:
                return self.runtime is not None
            except BackendUnavailableError as exc:
                log.warning("backends_unavailable", failures=waits.failures + 1, error=str(exc))
                waits.failed(stopping=self._stop)
        return False

    def stop(self) -> None:
        """Ask `run()` to finish the messages in hand and return."""
        self._stop.set()

    def purge_expired_tokens(self) -> int:
        """Delete expired token records now (a running worker does it every `PURGE_INTERVAL`)."""
        deleted = self.runtime.store.purge_expired()
        if deleted:
            log.info("expired_tokens_purged", count=deleted)
        return deleted

    def _purge_expired_tokens(self) -> None:
        now = self.clock.monotonic()
        if now - self._purged_at < PURGE_INTERVAL:
            return
        self._purged_at = now
        try:
            self.purge_expired_tokens()
        except StoreUnavailableError as exc:
            log.warning("token_purge_failed", error=str(exc))

    def _cycle(self, workers: list[Worker], until_idle: bool) -> bool:
        timeout = 0.0 if until_idle else max(w.handler.config.poll_timeout for w in workers) / len(workers)
        fetched = sum(w.poll(timeout) for w in workers)
        if not fetched:
            for w in workers:
                w.flush()
        return fetched > 0

    def _wait_for_due(self, workers: list[Worker], announced: float | None) -> tuple[bool, float | None]:
        """Sleep until the next scheduled message is due (False when nothing is pending), saying
        once per redelivery that it waits for it (`waiting_for_redelivery`), unless it is due
        within the second: a 10-minute delay was 10 minutes of silence. Returns the one said.
        At least 1 ms, so a due time kept on the monotonic clock, read a rounding early, never spins it."""
        pending = [w.pending() for w in workers]
        if not any(pending):
            return False, announced
        dues = [d for w in workers if (d := w.next_due()) is not None]
        now = self.clock.time()
        if dues and (due := min(dues)) != announced and due - now > 1.0:
            log.info("waiting_for_redelivery", due_in=round(due - now, 3), pending=sum(pending))
            announced = due
        # nothing scheduled: a message is in flight elsewhere (its lease may expire): poll soon
        self.clock.sleep(min(max(min(dues) - now, 0.001), 1.0) if dues else 0.05)
        return True, announced

    def _select(self, names: Sequence[str] | None) -> list[Handler]:
        if not self.handlers:
            raise UnknownHandlerError("no handler is registered on this app")
        if names is None:
            return list(self.handlers.values())
        unknown = [n for n in names if n not in self.handlers]
        if unknown:
            raise UnknownHandlerError(f"no handler named {', '.join(unknown)}; registered: {', '.join(self.handlers)}")
        return [self.handlers[n] for n in names]

    def _warn_unused_handler_settings(self) -> None:
        """Name each ``[handlers.NAME]`` table no handler of this app reads: a misspelt name leaves
        its overrides unused, silently. A warning, not an error: another app may share the file."""
        for name in sorted(set(self.settings.handlers) - set(self.handlers)):
            guess = difflib.get_close_matches(name, list(self.handlers), n=1)
            log.warning("handler_settings_unused", table=f"handlers.{name}", handlers=sorted(self.handlers),
                        did_you_mean=f"handlers.{guess[0]}" if guess else None)

    def _worker(self, handler: Handler) -> Worker:
        handler.config = self.config_for(handler)
        return Worker(handler, self.runtime, self._strategy(handler.config), self._stop, self.middleware)

    def config_for(self, handler: Handler) -> HandlerConfig:
        """The handler's effective settings: its decorator options over the settings file."""
        s = self.settings.for_handler(handler.name)
        return HandlerConfig(
            redelivery=handler.retry or s.retry.policy(),
            in_process=handler.in_process or s.retry.in_process(),
            token_ttl=s.store.token_ttl,
            cache_ttl=s.cache.ttl,
            commit=handler.commit or s.commit.strategy,
            commit_batch_size=s.commit.batch_size,
            commit_interval=s.commit.interval,
            concurrency=handler.concurrency or s.worker.concurrency,
            prefetch=handler.prefetch or s.worker.prefetch,
            poll_timeout=s.worker.poll_timeout,
        )

    @staticmethod
    def _strategy(config: HandlerConfig) -> CommitStrategy:
        if isinstance(config.commit, CommitStrategy):
            return config.commit
        # optimizeAck: never hold back more than ~65% of the prefetch window, so the
        # broker keeps sending while acks are pending
        size = min(config.commit_batch_size, max(1, math.ceil(OPTIMIZE_ACK_FRACTION * config.prefetch)))
        return commit_strategy(config.commit, size, config.commit_interval)

    # -- dead letters ---------------------------------------------------------

    @property
    def dead_letter_queue(self) -> DeadLetters:
        return DeadLetters(self.runtime.store, self.runtime.transport, self.middleware)

    def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        """The dead letters of ``group``, oldest first."""
        return self.dead_letter_queue.page(group, limit)

    def replay_dead_letters(self, group: str, ids: Sequence[int] | None = None, *, max_replays: int = 3, force: bool = False) -> int:
        """Publish dead letters back to their topic and delete them; returns how many."""
        return self.dead_letter_queue.replay(group, ids, max_replays=max_replays, force=force)

    def purge_dead_letters(self, group: str, ids: Sequence[int] | None = None) -> int:
        """Delete dead letters without replaying them; returns how many."""
        return self.dead_letter_queue.purge(group, ids)

    def close(self) -> None:
        """Close the backends."""
        with self._lock:
            if self._runtime is not None:
                for part in (self._runtime.transport, self._runtime.store, self._runtime.cache):
                    if part is not None:
                        part.close()
                self._runtime = None
