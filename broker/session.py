"""`Session`: one group member with ActiveMQ's acknowledgement modes, over any `BrokerApi`.

The engine knows ack *types* (STANDARD, REDELIVERED, POISON, ...): what one
acknowledgement means. An ack *mode* is a consumer's policy of when it sends
them, as a JMS session's is in ActiveMQ, so it lives here, on the client
side, and works the same in process (`broker.embedded`), over the local
socket and over TCP (`broker.client.Client`):

==============  ==================================================================
``AUTO``        a message is acknowledged as `receive` returns it
``CLIENT``      `acknowledge` acknowledges every message the session has received
                so far (cumulative, as ActiveMQ's ``CLIENT_ACKNOWLEDGE``)
``INDIVIDUAL``  `acknowledge` acknowledges the one message it is given
                (ActiveMQ's ``INDIVIDUAL_ACKNOWLEDGE``)
``DUPS_OK``     received messages are acknowledged lazily, in a batch once
                ``dups_ok_fraction`` of the prefetch is waiting or the oldest waited
                ``dups_ok_timeout`` seconds (ActiveMQ's optimised acknowledge): a
                crash repeats at most that batch
``TRANSACTED``  received messages and `send` calls form a set: `commit` publishes
                the sends and acknowledges the messages, `rollback` drops the sends
                and hands the messages back (REDELIVERED, after
                ``redelivery_delay(delivery count)``; past the broker's
                ``max_deliveries`` they go to ``%DLQ%<group>``)
==============  ==================================================================

`recover` (CLIENT, INDIVIDUAL) hands back what was received and not
acknowledged, as JMS's ``Session.recover``. `close` sends what DUPS_OK still
owes and leaves the group: whatever is unacknowledged then (including messages
fetched ahead and never received) is delivered again to the group.

A session fetches up to ``prefetch`` messages at a time (one round trip for
many `receive` calls). Messages fetched ahead and never received are released
at `close` (the broker's ``release``): delivered again as if never handed out,
their delivery count unmoved, so they neither come back marked redelivered nor
use up ``max_deliveries``. A session that dies without closing cannot say so:
its lease ends and they count as a delivery, as every delivery that ends
without an ack does.
In CLIENT, INDIVIDUAL and TRANSACTED mode the unacknowledged messages fill the
member's prefetch window: no more arrive until some are acknowledged.

A commit publishes first and acknowledges second: a crash between the two
delivers the received messages again, and the sends are then repeated unless
they carry message ids the broker's de-duplication window has seen (give sends
an id derived from what they answer to make a repeated commit harmless).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from broker.delivery.api import BrokerApi
from broker.delivery.values import Delivery, OutgoingMessage, Placement
from broker.errors import SessionError

__all__ = ["AckMode", "Session", "SessionError"]


class AckMode(enum.Enum):
    """When a session acknowledges what it receives (see the module's table)."""

    AUTO = "auto"
    CLIENT = "client"
    INDIVIDUAL = "individual"
    DUPS_OK = "dups_ok"
    TRANSACTED = "transacted"


class Session:
    """A member of ``group`` over ``topics`` that acknowledges as ``ack_mode`` says."""

    def __init__(self, api: BrokerApi, group: str, topics: Sequence[str],
                 ack_mode: AckMode = AckMode.AUTO, *, prefetch: int = 100,
                 dups_ok_fraction: float = 0.5, dups_ok_timeout: float = 0.3,
                 redelivery_delay: Callable[[int], float] = lambda count: 0.0,
                 clock: Callable[[], float] = time.monotonic, **join_options: Any) -> None:
        if prefetch < 1:
            raise SessionError(f"prefetch={prefetch!r}: must be at least 1")
        if not 0 < dups_ok_fraction <= 1:
            raise SessionError(f"dups_ok_fraction={dups_ok_fraction!r}: must be in (0, 1]")
        if dups_ok_timeout < 0:
            raise SessionError(f"dups_ok_timeout={dups_ok_timeout!r}: must be >= 0")
        self.api, self.group, self.ack_mode = api, group, ack_mode
        self.prefetch = prefetch
        self._dups_ok_batch = max(1, int(prefetch * dups_ok_fraction))
        self._dups_ok_timeout = dups_ok_timeout
        self._redelivery_delay = redelivery_delay
        self._clock = clock
        self._member: str | None = api.join(group, list(topics), prefetch=prefetch, **join_options)
        self._ahead: deque[Delivery] = deque()  # fetched, not yet received
        self._received: dict[str, Delivery] = {}  # received, not yet acknowledged (by receipt)
        self._oldest_owed: float | None = None  # DUPS_OK: when the oldest unacknowledged arrived
        self._sends: list[tuple[str, list[OutgoingMessage]]] = []  # TRANSACTED: published on commit

    @property
    def member(self) -> str:
        """The group member this session is (a closed session refuses every call)."""
        if self._member is None:
            raise SessionError(f"session of group {self.group!r} is closed")
        return self._member

    def receive(self, timeout: float = 0.0) -> Delivery | None:
        """The next message, waiting up to ``timeout`` seconds for one; None if none came."""
        member = self.member
        if self.ack_mode is AckMode.DUPS_OK:
            self._settle_dups_ok(due_only=True)
        if not self._ahead:
            self._ahead.extend(self.api.fetch(member, self.prefetch, timeout))
        if not self._ahead:
            return None
        delivery = self._ahead.popleft()
        if self.ack_mode is AckMode.AUTO:
            self.api.ack(member, [delivery.receipt])
            return delivery
        self._received[delivery.receipt] = delivery
        if self.ack_mode is AckMode.DUPS_OK:
            self._oldest_owed = self._oldest_owed if self._oldest_owed is not None else self._clock()
            self._settle_dups_ok(due_only=True)
        return delivery

    def acknowledge(self, delivery: Delivery | None = None) -> None:
        """CLIENT: every message received so far (``delivery`` may name any of them);
        INDIVIDUAL: ``delivery`` alone."""
        member = self.member
        if self.ack_mode is AckMode.CLIENT:
            receipts = list(self._received)
            self._received.clear()
        elif self.ack_mode is AckMode.INDIVIDUAL:
            if delivery is None:
                raise SessionError("INDIVIDUAL: acknowledge(delivery) names the message to acknowledge")
            if self._received.pop(delivery.receipt, None) is None:
                return  # acknowledged before, or handed back by recover(): nothing to do
            receipts = [delivery.receipt]
        else:
            raise SessionError(f"acknowledge() is for CLIENT and INDIVIDUAL sessions, not {self.ack_mode.name}")
        if receipts:
            self.api.ack(member, receipts)

    def recover(self) -> None:
        """CLIENT, INDIVIDUAL: hand back every received, unacknowledged message; it comes again."""
        if self.ack_mode not in (AckMode.CLIENT, AckMode.INDIVIDUAL):
            raise SessionError(f"recover() is for CLIENT and INDIVIDUAL sessions, not {self.ack_mode.name}")
        self._hand_back(delay_of=lambda count: 0.0)

    def send(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        """Publish ``messages``; in a TRANSACTED session they wait for `commit` (no placements yet)."""
        if self.member and self.ack_mode is AckMode.TRANSACTED:
            self._sends.append((topic, list(messages)))
            return []
        return self.api.publish(topic, messages)

    def commit(self) -> list[Placement]:
        """TRANSACTED: publish the sends, then acknowledge every message received since the last
        commit or rollback; the placements of the sends."""
        member = self._transacted("commit")
        placed = [placement for topic, messages in self._sends for placement in self.api.publish(topic, messages)]
        self._sends.clear()
        if self._received:
            self.api.ack(member, list(self._received))
            self._received.clear()
        return placed

    def rollback(self) -> None:
        """TRANSACTED: drop the sends; hand the received messages back (REDELIVERED)."""
        self._transacted("rollback")
        self._sends.clear()
        self._hand_back(delay_of=self._redelivery_delay)

    def close(self) -> None:
        """Send what DUPS_OK owes, release what was fetched ahead and never received, and leave:
        every unacknowledged message is delivered again."""
        if self._member is None:
            return
        try:
            if self.ack_mode is AckMode.DUPS_OK:
                self._settle_dups_ok(due_only=False)
            if self._ahead:
                self.api.release(self._member, [delivery.receipt for delivery in self._ahead])
            self.api.leave(self._member)
        finally:
            self._member = None
            self._ahead.clear()
            self._received.clear()
            self._sends.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside -------------------------------------------------------------------------

    def _settle_dups_ok(self, due_only: bool) -> None:
        if not self._received:
            return
        waited = self._oldest_owed is not None and self._clock() - self._oldest_owed >= self._dups_ok_timeout
        if due_only and len(self._received) < self._dups_ok_batch and not waited:
            return
        self.api.ack(self.member, list(self._received))
        self._received.clear()
        self._oldest_owed = None

    def _hand_back(self, delay_of: Callable[[int], float]) -> None:
        """Every received, unacknowledged message back to the group, grouped by its delay."""
        by_delay: dict[float, list[str]] = {}
        for delivery in self._received.values():
            by_delay.setdefault(max(0.0, delay_of(delivery.delivery_count)), []).append(delivery.receipt)
        self._received.clear()
        for delay, receipts in by_delay.items():
            self.api.nack(self.member, receipts, delay)

    def _transacted(self, call: str) -> str:
        if self.ack_mode is not AckMode.TRANSACTED:
            raise SessionError(f"{call}() is for TRANSACTED sessions, not {self.ack_mode.name}")
        return self.member
