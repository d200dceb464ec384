"""reliable: consumer-side reliability for Python.

Decorate a consumer with ``@app.handler(...)`` and every message gets an
idempotency check (cache, then a unique index claimed in the handler's own
transaction), retry with backoff (in process, then redelivery with a growing
delay), poison routing to a dead-letter queue, and a commit strategy.
"""

from __future__ import annotations

from typing import Any

from backends.clock import FakeClock, SystemClock
from reliable.app import App
from reliable.commit import Async, Batch, CommitStrategy, OffsetWatermark, PerMessage, Transactional
from reliable.errors import (
    ConfigurationError,
    HandlerOptionError,
    ReliableError,
    ReplayLoopError,
    TokenMissingError,
)
from reliable.handler import Handler
from reliable.idempotency import Token
from reliable.message import DeadLetter, Failure, Message, OutgoingMessage, QueueRef
from reliable.middleware import Middleware, Publish
from reliable.outcome import Outcome, Result
from reliable.retry import (
    DelayLevels,
    InProcessRetry,
    RedeliveryPolicy,
    Verdict,
    fatal_on,
    retry_on,
    when,
)
from reliable.settings import Settings

__all__ = [
    "App",
    "Async",
    "Batch",
    "CommitStrategy",
    "ConfigurationError",
    "DeadLetter",
    "DelayLevels",
    "Failure",
    "FakeClock",
    "Handler",
    "HandlerOptionError",
    "InProcessRetry",
    "Message",
    "Middleware",
    "OffsetWatermark",
    "Outcome",
    "OutgoingMessage",
    "PerMessage",
    "Publish",
    "QueueRef",
    "RedeliveryPolicy",
    "ReliableError",
    "ReplayLoopError",
    "Result",
    "Settings",
    "SystemClock",
    "Token",
    "TokenMissingError",
    "Transactional",
    "Verdict",
    "default_app",
    "fatal_on",
    "handler",
    "retry_on",
    "when",
]

_default_app: App | None = None


def default_app() -> App:
    """The app behind the module-level `handler` decorator (created on first use)."""
    global _default_app
    if _default_app is None:
        _default_app = App()
    return _default_app


def handler(topic: str, **options: Any) -> Any:
    """``@reliable.handler(...)``: register on the default app (see `App.handler`)."""
    return default_app().handler(topic, **options)
