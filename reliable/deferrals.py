"""Deliveries that were deferred, not failed: waiting out an outage is no attempt of the message's.

The transport counts every delivery (`Message.attempt`), those that came back
because the store could not be used (a full disk, a database out of reach)
or a lease was held elsewhere included. A long outage would leave a message
with hundreds of deliveries, and its first real failure after the outage
would find its attempts spent: dead-lettered because of the outage. The
pipeline counts what it deferred, per message id, and the redelivery policy
sees only the deliveries that were attempts. The count is kept in memory,
bounded (`LIMIT` messages, the least recently deferred forgotten first): a
worker restarted during an outage counts its deliveries again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from backends.types import Message

LIMIT = 100_000


class Deferrals:
    """How often each message in hand was deferred, and its attempts without them."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()  # lanes of one handler share it

    def deferred(self, message: Message) -> None:
        """``message`` goes back to the transport without having been attempted."""
        with self._lock:
            self._counts[message.id] = self._counts.pop(message.id, 0) + 1
            if len(self._counts) > self._limit:
                self._counts.popitem(last=False)

    def settled(self, messages: Iterable[Message]) -> None:
        """``messages`` are done for the group: nothing more to count."""
        if not self._counts:  # the common case, no outage: nothing to look up
            return
        with self._lock:
            for message in messages:
                self._counts.pop(message.id, None)

    def attempt(self, message: Message) -> int:
        """The number of this delivery among the attempts of ``message`` (deferred ones left out)."""
        with self._lock:
            deferred = self._counts.get(message.id, 0)
        return max(1, message.attempt - deferred)
