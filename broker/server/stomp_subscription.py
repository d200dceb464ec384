"""One STOMP subscription: a group member whose deliveries are pushed as MESSAGE frames.

``/queue/NAME`` joins the group ``NAME`` over topic ``NAME`` (every subscriber
of the queue shares its messages); ``/topic/NAME`` joins the broadcasting group
``%STOMP%NAME`` as a member of its own that starts at the end of topic ``NAME``. At most
``prefetch`` messages are unacknowledged at a time (``activemq.prefetchSize``);
in ``auto`` mode a message counts as acknowledged once written.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from broker.delivery.group import STOMP_TOPIC_PREFIX
from broker.delivery.topics import MAX_NAME, RETRY_PREFIX
from broker.protocol.errors import MalformedFrameError, RequestError
from broker.server.config import Limits
from broker.server.engine import Delivery, Engine
from broker.server.stomp_codec import carried

AckMode = Literal["auto", "client", "client-individual"]
ACK_MODES: tuple[AckMode, ...] = ("auto", "client", "client-individual")
FETCH_WAIT = 5.0
_DESTINATION = re.compile(r"/(queue|topic)/([^/\s]+)")
_LONGEST_GROUP = MAX_NAME - len(RETRY_PREFIX)

SendMessage = Callable[["StompSubscription", Delivery, str], Awaitable[None]]


def message_id_of(delivery: Delivery, ack_id: str) -> str:
    """The ``message-id`` of ``delivery``'s MESSAGE frame: the broker's message id, or, where
    a STOMP version could not carry that (`carried`), the frame's ack id: 1.0 and 1.1 clients
    acknowledge by it."""
    return delivery.message_id if carried("message-id", delivery.message_id, "1.0") else ack_id


@dataclass(frozen=True)
class Destination:
    """A STOMP destination and the broker topic it names."""

    raw: str
    kind: Literal["queue", "topic"]
    topic: str

    @classmethod
    def parse(cls, raw: str | None) -> Destination:
        match = _DESTINATION.fullmatch(raw or "")
        if match is None:
            raise MalformedFrameError(f"destination {raw!r} is not /queue/NAME or /topic/NAME")
        kind: Literal["queue", "topic"] = "queue" if match.group(1) == "queue" else "topic"
        return cls(raw or "", kind, match.group(2))

    @property
    def group(self) -> str:
        """The group a subscription joins: ``NAME`` for ``/queue/NAME``; for ``/topic/NAME``
        ``%STOMP%NAME``, one broadcasting group per topic whose every subscription is a member
        of its own (a group per subscription would leave a group, and a ``%RETRY%`` topic on
        disk, behind every SUBSCRIBE). A name too long for a group ends in a digest instead."""
        if self.kind == "queue":
            return self.topic
        group = STOMP_TOPIC_PREFIX + self.topic
        if len(group) <= _LONGEST_GROUP:
            return group
        digest = hashlib.sha256(self.topic.encode()).hexdigest()[:16]
        return f"{group[:_LONGEST_GROUP - len(digest) - 1]}%{digest}"


class StompSubscription:
    """Fetches for one member and pushes what it gets, within the prefetch window."""

    def __init__(self, sub_id: str, destination: Destination, ack_mode: AckMode, prefetch: int,
                 member: str, engine: Engine, send: SendMessage, next_ack_id: Callable[[], str],
                 limits: Limits) -> None:
        self.id = sub_id
        self.destination = destination
        self.ack_mode = ack_mode
        self.prefetch = prefetch
        self.member = member
        self.engine = engine
        self._send = send
        self._next_ack_id = next_ack_id
        self._wait = min(FETCH_WAIT, limits.max_fetch_wait)
        self.limits = limits
        self.pending: OrderedDict[str, Delivery] = OrderedDict()
        self._by_message_id: dict[str, str] = {}
        self._window_open = asyncio.Event()
        self._window_open.set()
        self._task: asyncio.Task[None] | None = None

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        self._task = asyncio.create_task(self._deliver())
        self._task.add_done_callback(
            lambda t: None if t.cancelled() or t.exception() is None else on_failure(t.exception()))  # type: ignore[arg-type]

    async def _deliver(self) -> None:
        while True:
            await self._window_open.wait()
            room = self.prefetch - len(self.pending)
            deliveries = await self.engine.fetch(self.member, room, self._wait)
            for sent, delivery in enumerate(deliveries):
                ack_id = self._next_ack_id()
                if self.ack_mode != "auto":
                    self.pending[ack_id] = delivery
                    self._by_message_id[message_id_of(delivery, ack_id)] = ack_id
                try:
                    await self._send(self, delivery, ack_id)
                except BaseException:  # stopped, or the client gone: what follows was never sent
                    await asyncio.shield(self.engine.give_back([d.receipt for d in deliveries[sent + 1:]]))
                    raise
            if self.ack_mode == "auto" and deliveries:
                await self.engine.ack(self.member, [d.receipt for d in deliveries])
            if len(self.pending) >= self.prefetch:
                self._window_open.clear()

    def ack_id_for(self, message_id: str) -> str | None:
        """The pending ack id of the message ``message_id`` (STOMP 1.0/1.1 ack by message-id)."""
        return self._by_message_id.get(message_id)

    def select(self, ack_id: str) -> list[str]:
        """The ack ids one ACK/NACK of ``ack_id`` settles: up to it in ``client`` mode, else itself."""
        if ack_id not in self.pending:
            raise RequestError(f"ack id {ack_id!r} is not pending on subscription {self.id!r}")
        if self.ack_mode != "client":
            return [ack_id]
        chosen = []
        for candidate in self.pending:
            chosen.append(candidate)
            if candidate == ack_id:
                return chosen
        return chosen

    async def settle(self, ack_ids: Sequence[str], redeliver: bool) -> None:
        """ACK (``redeliver`` false) or NACK the deliveries of ``ack_ids`` that are still pending."""
        settled = [(a, self.pending.pop(a)) for a in ack_ids if a in self.pending]
        for ack_id, delivery in settled:
            self._by_message_id.pop(message_id_of(delivery, ack_id), None)
        deliveries = [delivery for _, delivery in settled]
        if not deliveries:
            return
        if not redeliver:
            await self.engine.ack(self.member, [d.receipt for d in deliveries])
        for delivery in deliveries if redeliver else ():
            await self._nacked(delivery)
        self._window_open.set()

    async def _nacked(self, delivery: Delivery) -> None:
        """NACK follows the redelivery policy: delivered again after its delay, and after
        ``stomp_max_redeliveries`` redeliveries to ``%DLQ%<group>`` with the cause."""
        redeliveries = delivery.delivery_count - 1
        if redeliveries >= self.limits.stomp_max_redeliveries:
            reason = (f"NACKed after {redeliveries} redeliveries "
                      f"(stomp_max_redeliveries={self.limits.stomp_max_redeliveries})")
            await self.engine.dead_letter(self.member, [delivery.receipt], reason)
        else:
            delay = self.limits.stomp_nack_delay(delivery.delivery_count)
            await self.engine.nack(self.member, [delivery.receipt], delay)

    async def stop(self) -> None:
        """Stop delivering and leave the group: unacknowledged messages are redelivered."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pending.clear()
        await self.engine.leave(self.member)
