"""The errors the broker server and its client raise; all derive from `broker.errors.BrokerError`.

Every error that travels on the wire has a stable ``code`` (the native
protocol's error code and the STOMP ERROR frame's ``message`` prefix), so a
client can map a refusal back to the same class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.errors import BrokerError


class ServerError(BrokerError):
    """Raised for a situation the server or client detects; ``code`` names it on the wire."""

    code = "server_error"

    @classmethod
    def from_wire(cls, message: str, error: Mapping[str, Any]) -> ServerError:
        """The error a client raises for the ``error`` of a reply (its ``message`` given)."""
        return cls(message)


class ProtocolError(ServerError):
    """Raised when bytes on a connection do not follow the protocol."""

    code = "protocol_error"
    #: whether the connection must be closed after the error is reported
    fatal = False


class FrameTooLargeError(ProtocolError):
    """Raised when a frame's announced size exceeds the configured maximum (before its body is read)."""

    code = "frame_too_large"
    fatal = True


class UnsupportedVersionError(ProtocolError):
    """Raised when a native frame carries a protocol version this server does not speak."""

    code = "unsupported_version"
    fatal = True


class MalformedFrameError(ProtocolError):
    """Raised when a frame's framing is intact but its content is not a valid request."""

    code = "malformed_frame"


class BrokenStreamError(ProtocolError):
    """Raised when the framing itself is broken (a STOMP command or header line that cannot be read)."""

    code = "broken_stream"
    fatal = True


class UnknownOperationError(ProtocolError):
    """Raised when a well-formed frame names an operation the server does not know."""

    code = "unknown_operation"


class LimitExceededError(ProtocolError):
    """Raised when a connection would pass one of its bounds (open transactions, bytes they buffer)."""

    code = "limit_exceeded"
    fatal = True


class RequestLimitError(LimitExceededError):
    """Raised when a request would take a connection past a bound on what it holds at once
    (``max_subscriptions``, ``max_waiting_requests``): that request is refused, and a native
    connection serves on."""

    fatal = False


class AuthenticationError(ServerError):
    """Raised when credentials are missing or wrong."""

    code = "unauthenticated"


class LockedOutError(AuthenticationError):
    """Raised when the client's address is locked out for failed authentications (whatever the
    credentials); ``retry_after``: the seconds the lock-out still lasts.

    A client that does not know the code ``locked_out`` takes it for what it was before it had a
    code of its own: an authentication refused (``unauthenticated``), fatal."""

    code = "locked_out"

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @classmethod
    def from_wire(cls, message: str, error: Mapping[str, Any]) -> ServerError:
        retry_after = error.get("retry_after")
        return cls(message, float(retry_after) if isinstance(retry_after, int | float) else 0.0)


class PermissionDeniedError(ServerError):
    """Raised when an authenticated user may not produce to or consume from a topic."""

    code = "permission_denied"


class RequestError(ServerError):
    """Raised when a request is well formed but cannot be served (an unknown member or receipt)."""

    code = "bad_request"


class ConnectionLimitError(ServerError):
    """Raised when a listener already holds its maximum number of connections."""

    code = "too_many_connections"


class ClientError(ServerError):
    """Raised by `broker.client` when the server refused a request; ``code`` is the server's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ClientClosedError(ServerError):
    """Raised by `broker.client` when a closed producer or consumer is used."""

    code = "closed"


WIRE_ERRORS: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (
        ProtocolError, FrameTooLargeError, UnsupportedVersionError, MalformedFrameError,
        BrokenStreamError, UnknownOperationError, LimitExceededError, AuthenticationError,
        LockedOutError, PermissionDeniedError, RequestError, ConnectionLimitError,
    )
}
