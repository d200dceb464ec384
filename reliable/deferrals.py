"""Deliveries that were deferred, not failed: waiting out an outage is no attempt of the message's.

The transport counts every delivery (`Message.attempt`), those that came back
because the store could not be used (a full disk, a database out of reach)
or a lease was held elsewhere included. Fetching on through an outage of
minutes would give a message a delivery every ``initial_delay``, and its
first real failure after the outage would find its attempts spent:
dead-lettered because of the outage. Two things keep that from happening:

* `StoreGate`: once a message was deferred because the store could not be
  used, the worker fetches nothing until the store takes a write again (one
  small committed write, with a growing wait between tries); a worker starts
  with the gate closed, so one restarted during an outage fetches nothing
  either. The probe writes because a read would pass on a full disk, which
  still answers reads: the worker would fetch, defer and spend a delivery
  every round. An outage or a full disk costs a message in hand when it began
  one delivery, whatever its length and however often the worker is
  restarted meanwhile. A disk with a little room left takes the probe's small
  write but maybe not a handler's large one: each round then still costs a
  delivery, counted as below.
* `Deferrals`: the pipeline counts what it deferred, per message id, and the
  redelivery policy sees only the deliveries that were attempts. The count is
  kept in memory, bounded (`LIMIT` messages, the least recently deferred
  forgotten first): a restarted worker starts counting again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import structlog

from backends.clock import Clock
from backends.errors import StoreUnavailableError
from backends.store.base import Store
from backends.types import Message
from reliable.retry import Backoff

log = structlog.get_logger("reliable.deferrals")

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


class StoreGate:
    """Whether a worker may fetch: not while its store is known to be down or refusing writes
    (closed at start)."""

    def __init__(self, store: Store, clock: Clock, handler: str, stopping: threading.Event | None = None) -> None:
        self._store, self._handler, self._stopping = store, handler, stopping
        self._backoff = Backoff(clock)  # 0.1 s doubling to 5 s
        self._open = False

    def store_down(self) -> None:
        """A message was deferred because the store could not be used: fetch no more until it
        takes a write."""
        self._open = False

    def passes(self) -> bool:
        """True while the gate is open, or once the store takes a write (`Store.ping_write`); else
        False after the next wait of the backoff (cut short when the worker stops)."""
        if self._open:
            return True
        try:
            self._store.ping_write()
        except StoreUnavailableError as exc:
            error = str(exc)
            self._backoff.failed(lambda failures, delay: log.warning(
                "store_unavailable", handler=self._handler, failures=failures, retry_in=round(delay, 3),
                error=error, fetching="held until the store takes a write"), self._stopping)
            return False
        if failures := self._backoff.succeeded():
            log.info("store_reachable", handler=self._handler, after_failures=failures)
        self._open = True
        return True
