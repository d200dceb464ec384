"""Every error `reliable` raises, under one root (`ReliableError`).

The root and the backend errors live in `backends.errors` (the lowest layer
the framework imports); they are re-exported here so users import one module.
"""

from __future__ import annotations

from backends.errors import (
    BackendRefusedError,
    BackendUnavailableError,
    BodyDecodeError,
    CacheUnavailableError,
    ConfigurationError,
    DiskFullError,
    FenceConflictError,
    OutboxMessageError,
    ReliableError,
    StoreUnavailableError,
    TransportError,
    UnreadableMessageError,
    UnsupportedURLError,
    WritesRefusedError,
)

__all__ = [
    "BackendRefusedError",
    "BackendUnavailableError",
    "BodyDecodeError",
    "BodyValidationError",
    "CacheUnavailableError",
    "ConfigurationError",
    "DeadLetterNotFoundError",
    "DiskFullError",
    "ExtraNotInstalledError",
    "FenceConflictError",
    "HandlerOptionError",
    "HandlerShapeError",
    "LeaseHeldError",
    "MiddlewareError",
    "OutboxMessageError",
    "ReliableError",
    "ReplayLoopError",
    "ReplayRefusedError",
    "StoreUnavailableError",
    "TokenInvalidError",
    "TokenMissingError",
    "TransportError",
    "UnknownHandlerError",
    "UnreadableMessageError",
    "UnsupportedURLError",
    "WritesRefusedError",
]


class BodyValidationError(BodyDecodeError):
    """Raised when a body decodes but does not validate into the handler's annotated type
    (a pydantic model or dataclass): the message is poison, dead-lettered with the errors."""


class TokenMissingError(ReliableError):
    """Raised when a message has no idempotency token where one is required (it is poison)."""


class TokenInvalidError(ReliableError):
    """Raised when a message's token is one the store cannot record (too long, or holding a NUL
    character): the message is poison, before any claim."""


class HandlerOptionError(ConfigurationError):
    """Raised when `@app.handler(...)` is given an invalid option (at decoration time)."""


class HandlerShapeError(ReliableError):
    """Raised when a handler call returned an awaitable or generator it cannot be run to completion
    from (its body never ran): the message is poison, never counted processed."""


class UnknownHandlerError(ConfigurationError):
    """Raised when a handler or group name does not match any registered handler."""


class ReplayLoopError(ReliableError):
    """Raised when a dead letter was already replayed as often as allowed."""


class ReplayRefusedError(ReliableError):
    """Raised after a replay when the transport refused some of its dead letters for good (a
    message too large, a topic name it does not take): those stay, unchanged; the rest were replayed.
    ``replayed`` says how many were, ``refused`` maps each refused letter's id to the reason."""

    def __init__(self, message: str, replayed: int, refused: dict[int, str]) -> None:
        super().__init__(message)
        self.replayed, self.refused = replayed, refused


class LeaseHeldError(ReliableError):
    """Raised when another worker holds the lease of a token (the message is retried later)."""


class DeadLetterNotFoundError(ReliableError, LookupError):
    """Raised when a dead letter asked for by id is not in the group named."""


class MiddlewareError(ConfigurationError):
    """Raised when something that is not a `reliable.Middleware` is registered as one."""


class ExtraNotInstalledError(ConfigurationError, ImportError):
    """Raised when a feature is used without its optional dependencies; names the pip extra."""
