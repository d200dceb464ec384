"""`Consumer`: one group member over `broker.client.Client` that joins again after a lost connection.

The server lets a member go with its connection: its unacknowledged messages
go to other members, or back to this one once it has joined again. A
`Consumer` hides that: `fetch` reconnects and rejoins with backoff
(tenacity) and the group goes on from its committed offsets; settling a
delivery of a member that is gone is skipped, since that message comes back.
`broker.async_client.AsyncConsumer` is the same for asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from broker.client import Client
from broker.delivery.values import Delivery
from broker.errors import BrokerUnavailableError, UnknownMemberError

log = structlog.get_logger("broker.client")
_LOST = (BrokerUnavailableError, UnknownMemberError)


class Consumer:
    """A member of ``group`` over ``topics`` that survives reconnects of its `Client`."""

    def __init__(self, client: Client, group: str, topics: Sequence[str], *,
                 reconnect_seconds: float = 30.0, **join_options: Any) -> None:
        self.client = client
        self.group = group
        self.topics = list(topics)
        self._options = join_options
        self._reconnect_seconds = reconnect_seconds
        self._member: str | None = None
        self._holders: dict[str, str] = {}  # receipt -> the member it was delivered to

    def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages``; on a lost connection, reconnect and rejoin (with backoff) first."""
        for attempt in Retrying(retry=retry_if_exception_type(BrokerUnavailableError),
                                wait=wait_exponential(multiplier=0.05, max=2.0),
                                stop=stop_after_delay(self._reconnect_seconds), reraise=True):
            with attempt:
                member = self._joined()
                try:
                    got = self.client.fetch(member, max_messages, timeout)
                except _LOST:
                    self._member = None
                    raise BrokerUnavailableError(f"member of {self.group!r} lost") from None
        self._holders.update({d.receipt: member for d in got})
        return got

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """STANDARD for the deliveries this member still holds (the others come back anyway)."""
        self._settle(deliveries, self.client.ack)

    def nack(self, deliveries: Sequence[Delivery], delay: float) -> None:
        self._settle(deliveries, lambda member, receipts: self.client.nack(member, receipts, delay))

    def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        self._settle(deliveries, lambda member, receipts: self.client.dead_letter(member, receipts, reason))

    def close(self) -> None:
        if self._member is not None:
            try:
                self.client.leave(self._member)
            except _LOST:
                pass
            self._member = None

    def _settle(self, deliveries: Sequence[Delivery], call: Callable[[str, list[str]], None]) -> None:
        receipts = [d.receipt for d in deliveries if self._holders.pop(d.receipt, None) == self._member]
        if receipts and self._member is not None:
            try:
                call(self._member, receipts)
            except _LOST:
                self._member = None  # they are delivered again; the next fetch rejoins

    def _joined(self) -> str:
        if self._member is None:
            self._member = self.client.join(self.group, self.topics, **self._options)
            log.info("client.joined", group=self.group, member=self._member)
        return self._member
