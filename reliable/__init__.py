"""reliable: consumer-side reliability for Python.

Decorate a consumer with ``@app.handler(...)`` and every message gets an
idempotency check (cache, then a unique index claimed in the handler's own
transaction), retry with backoff (in process, then redelivery with a growing
delay), poison routing to a dead-letter queue, and a commit strategy.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.clock import FakeClock, SystemClock
    from reliable.app import App
    from reliable.commit import (
        Async,
        Batch,
        CommitStrategy,
        OffsetWatermark,
        PerMessage,
        Transactional,
    )
    from reliable.errors import (
        ConfigurationError,
        HandlerOptionError,
        ReliableError,
        ReplayLoopError,
        TokenInvalidError,
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

# Where each public name lives: imported on first use (module ``__getattr__``), so a
# process that needs one submodule (a Spark executor reading `reliable.spark.source`)
# does not import the app, the store and SQLAlchemy.
_HOMES = {
    "FakeClock": "backends.clock", "SystemClock": "backends.clock",
    "App": "reliable.app",
    **dict.fromkeys(("Async", "Batch", "CommitStrategy", "OffsetWatermark", "PerMessage", "Transactional"),
                    "reliable.commit"),
    **dict.fromkeys(("ConfigurationError", "HandlerOptionError", "ReliableError", "ReplayLoopError",
                     "TokenInvalidError", "TokenMissingError"), "reliable.errors"),
    "Handler": "reliable.handler",
    "Token": "reliable.idempotency",
    **dict.fromkeys(("DeadLetter", "Failure", "Message", "OutgoingMessage", "QueueRef"), "reliable.message"),
    "Middleware": "reliable.middleware", "Publish": "reliable.middleware",
    "Outcome": "reliable.outcome", "Result": "reliable.outcome",
    **dict.fromkeys(("DelayLevels", "InProcessRetry", "RedeliveryPolicy", "Verdict", "fatal_on", "retry_on",
                     "when"), "reliable.retry"),
    "Settings": "reliable.settings",
}  # fmt: skip

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
    "TokenInvalidError",
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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'reliable' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def default_app() -> App:
    """The app behind the module-level `handler` decorator (created on first use)."""
    global _default_app
    if _default_app is None:
        from reliable.app import App

        _default_app = App()
    return _default_app


def handler(topic: str, **options: Any) -> Any:
    """``@reliable.handler(...)``: register on the default app (see `App.handler`)."""
    return default_app().handler(topic, **options)
