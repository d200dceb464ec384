"""The error root of the project and the errors raised by backends.

The root lives here, in the lowest layer the framework imports, so that
backends and framework share one hierarchy; ``reliable.errors`` re-exports it.
"""

from __future__ import annotations


class ReliableError(Exception):
    """Raised for every situation `reliable` itself detects."""


class ConfigurationError(ReliableError):
    """Raised when a setting, URL or option is invalid."""


class UnsupportedURLError(ConfigurationError):
    """Raised when a backend URL has a scheme no backend handles."""


class BackendRefusedError(ConfigurationError):
    """Raised when a server refuses what a setting says (a wrong login, a database or virtual
    host that does not exist) before the backend ever worked with it: waiting will not fix it.

    ``setting`` names the setting (``[store] url``); the message carries the server's words.
    """

    def __init__(self, setting: str, words: str) -> None:
        super().__init__(f"{setting}: the server refused it: {words}")
        self.setting = setting
        self.words = words


class BackendUnavailableError(ReliableError):
    """Raised when a cache, store or transport cannot be reached."""


class CacheUnavailableError(BackendUnavailableError):
    """Raised when the cache cannot be reached (the pipeline degrades to the store)."""


class StoreUnavailableError(BackendUnavailableError):
    """Raised when the store cannot be reached (the message is not acked)."""


class WritesRefusedError(BackendUnavailableError):
    """Raised when a backend is reachable but refuses writes for now (a full disk, a RabbitMQ
    memory or disk alarm): an outage, not poison; a worker keeps its place in its group."""


class DiskFullError(WritesRefusedError):
    """Raised when a backend refuses a write because its disk is full (an outage, not poison:
    the write is tried again once space is back)."""


class TransportError(ReliableError):
    """Raised when a transport rejects or cannot perform an operation."""


class BodyDecodeError(ReliableError):
    """Raised when a message body cannot be decoded (the message is poison)."""


class UnreadableMessageError(ReliableError):
    """Raised when a transport could not read a delivered message as another program wrote it
    (the message is poison)."""


class FenceConflictError(ReliableError):
    """Raised when a batch fence name is reused by a different run (e.g. a fresh checkpoint)."""


class OutboxMessageError(ReliableError):
    """Raised when `Transaction.publish` is given a message it cannot write to the outbox."""
