"""The broker's own error root and the errors its storage layer raises.

The broker does not import the framework, so it has its own hierarchy;
`backends` wraps these in `ReliableError` subclasses where it adapts the broker.
"""

from __future__ import annotations

import errno


class BrokerError(Exception):
    """Raised for every situation the broker itself detects."""


class BrokerConfigError(BrokerError):
    """Raised when a broker or store setting has a value outside what is allowed."""


class InvalidRecordError(BrokerError):
    """Raised when a record handed to the store is malformed (bad topic, queue or field)."""


class InvalidRequestError(BrokerError):
    """Raised when a read or lookup asks for something impossible (a negative offset or count)."""


class StoreError(BrokerError):
    """Raised when the message store cannot do what was asked."""


class StoreClosedError(StoreError):
    """Raised when a closed message store is used."""


class StoreLockedError(StoreError):
    """Raised when another process already has the store directory open."""


class RecordTooLargeError(StoreError):
    """Raised when a record's frame is larger than the configured maximum."""


class DiskFullError(StoreError):
    """Raised when disk usage has reached the refuse-writes threshold."""


def disk_full(exc: BaseException) -> DiskFullError | None:
    """``exc`` as the `DiskFullError` it means when it is a write refused for want of space (ENOSPC,
    EDQUOT) in one of the engine's own files, else None: what a client is told instead of a bare
    ``OSError``, so it waits for space rather than giving up."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"the broker cannot write: the disk is full ({exc})")
    return None


class CorruptStoreError(StoreError):
    """Raised when the store's files are inconsistent (a gap between segments, a bad checkpoint)."""


class CorruptRecordError(CorruptStoreError):
    """Raised when a stored record fails its CRC or framing check; names the file and offset."""

    def __init__(self, path: str, position: int, reason: str) -> None:
        super().__init__(f"corrupt record in {path} at byte {position}: {reason}")
        self.path = path
        self.position = position
        self.reason = reason


class DeliveryError(BrokerError):
    """Raised when the delivery engine cannot do what was asked."""


class UnknownMemberError(DeliveryError):
    """Raised when a call names a group member that left, timed out or never joined."""


class InvalidNameError(DeliveryError):
    """Raised when a topic or group name is empty, too long, or reserved (``%...%``)."""


class TooManyTopicsError(DeliveryError):
    """Raised when a publish would make a new topic while the broker holds ``max_topics`` topics."""


class TooManyGroupsError(DeliveryError):
    """Raised when a member would join a new group while the broker holds ``max_groups`` groups,
    or its user made ``max_groups_per_user`` on this server already."""


class BrokerUnavailableError(DeliveryError):
    """Raised when the process that owns an embedded broker's directory cannot be reached."""


class NotABrokerError(BrokerError):
    """Raised when the address a client connected to answers in another protocol than the broker's
    native one (the broker's STOMP port, another server): connecting again cannot help, so no
    client retries it."""


class SessionError(DeliveryError):
    """Raised when a `broker.session.Session` call is not one its ack mode allows, or it is closed."""
