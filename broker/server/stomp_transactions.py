"""The open STOMP transactions of one connection, bounded in number and in the bytes they hold.

A SEND, ACK or NACK naming a transaction waits in it for COMMIT. Every frame
is charged before it is kept (its body, its headers and a fixed cost for the
objects that hold it), so a client cannot grow the server past
``max_transaction_bytes`` per connection, however small its frames; a BEGIN
past ``max_transactions`` open ones is refused.
"""

from __future__ import annotations

from broker.protocol.errors import LimitExceededError, MalformedFrameError
from broker.server.config import Limits
from broker.server.stomp_codec import StompFrame

#: what a buffered frame costs beyond its bytes: the frame, its header dict and strings
FRAME_OVERHEAD = 512


def frame_cost(frame: StompFrame) -> int:
    """The bytes a buffered ``frame`` is charged."""
    headers = sum(len(name) + len(value) for name, value in frame.headers.items())
    return FRAME_OVERHEAD + len(frame.command) + headers + len(frame.body)


class StompTransactions:
    """Frames waiting for their COMMIT, per transaction name, with what they are charged."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._open: dict[str, list[StompFrame]] = {}
        self._charged = 0

    def begin(self, name: str | None) -> None:
        if not name or name in self._open:
            raise MalformedFrameError(f"BEGIN: transaction {name!r} is missing or already begun")
        if len(self._open) >= self._limits.max_transactions:
            raise LimitExceededError(f"BEGIN {name!r}: this connection already has "
                                     f"{len(self._open)} open transactions (max_transactions)")
        self._open[name] = []

    def add(self, name: str, frame: StompFrame) -> None:
        """Keep ``frame`` for ``name``'s COMMIT, once it is charged within the bound."""
        frames = self._frames(name)
        cost = frame_cost(frame)
        if self._charged + cost > self._limits.max_transaction_bytes:
            raise LimitExceededError(
                f"{frame.command} in transaction {name!r}: the open transactions of this connection "
                f"would hold {self._charged + cost} bytes, over max_transaction_bytes "
                f"{self._limits.max_transaction_bytes}")
        self._charged += cost
        frames.append(frame)

    def end(self, name: str | None) -> list[StompFrame]:
        """The frames of ``name`` (to commit, or to drop on ABORT); the transaction is over."""
        frames = self._frames(name)
        del self._open[name or ""]
        self._charged -= sum(frame_cost(frame) for frame in frames)
        return frames

    def _frames(self, name: str | None) -> list[StompFrame]:
        if name is None or name not in self._open:
            raise MalformedFrameError(f"transaction {name!r} has not begun")
        return self._open[name]
