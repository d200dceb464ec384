"""What became of a message after the pipeline ran: the worker acts on it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from backends.types import Failure, Message


class Outcome(enum.Enum):
    """The ack a message gets from the pipeline."""

    PROCESSED = "processed"  # STANDARD ack
    DUPLICATE = "duplicate"  # STANDARD ack, the handler did not run
    REDELIVERED = "redelivered"  # REDELIVERED: comes back after ``delay``
    DEAD_LETTERED = "dead_lettered"  # POISON: recorded in the dead-letter table
    DEFERRED = "deferred"  # no ack at all: the store was down, the message comes back


@dataclass(frozen=True)
class Result:
    """One message's outcome, with what the worker needs to acknowledge it."""

    message: Message
    outcome: Outcome
    token: str | None = None
    value: Any = None  # the handler's return value (lease mode: the stored one for duplicates)
    delay: float = 0.0  # REDELIVERED / DEFERRED: when to deliver again
    failure: Failure | None = None  # DEAD_LETTERED
    error: BaseException | None = None

    @property
    def acked(self) -> bool:
        """Whether the message is done for the group (acked STANDARD)."""
        return self.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE)
