"""What each client frame does once a STOMP connection is CONNECTED.

SEND, ACK and NACK carrying a ``transaction`` header wait for its COMMIT
(ABORT drops them: aborted acknowledgements leave their messages pending);
a frame with a ``receipt`` header is answered with RECEIPT once done.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Protocol

from broker.protocol.errors import (
    MalformedFrameError,
    RequestError,
    RequestLimitError,
    UnknownOperationError,
)
from broker.protocol.operations import OPERATIONS
from broker.server.auth import Principal
from broker.server.connection import Connection
from broker.server.engine import ByteWindow, Delivery, Engine, OutgoingMessage
from broker.server.quota import GroupQuota, TopicQuota
from broker.server.stomp_codec import StompFrame, parse_number
from broker.server.stomp_subscription import (
    ACK_MODES,
    AckMode,
    Destination,
    StompSubscription,
    message_id_of,
)
from broker.server.stomp_transactions import StompTransactions

#: frame headers that steer the broker and are not stored with the message
CONTROL_HEADERS = frozenset({"destination", "content-length", "receipt", "transaction",
                             "persistent", "message-id", "subscription", "ack", "redelivered"})
TRANSACTED = frozenset({"SEND", "ACK", "NACK"})
#: the rights of SEND and SUBSCRIBE: those of the native operations they map onto
SEND_ACCESS = OPERATIONS["publish"].access
QUEUE_ACCESS = OPERATIONS["subscribe"].access
TOPIC_ACCESS = OPERATIONS["read"].access
#: the commands of a connected client, each served by the handler method of its lower-case name
CONNECTED_COMMANDS = ("SEND", "SUBSCRIBE", "UNSUBSCRIBE", "ACK", "NACK", "BEGIN", "COMMIT",
                      "ABORT", "DISCONNECT")
#: every command a client may send: the only values the frame counter's ``command`` label takes
CLIENT_COMMANDS = frozenset({"CONNECT", "STOMP", *CONNECTED_COMMANDS})


class StompPeer(Protocol):
    """What the handlers use of the session that owns them (`stomp_session.StompSession`)."""

    conn: Connection
    engine: Engine
    quota: GroupQuota
    topic_quota: TopicQuota
    version: str  # the STOMP version agreed at CONNECT
    session_id: str

    async def send(self, frame: StompFrame) -> None: ...

    def report_failure(self, error: BaseException) -> None: ...


class StompHandlers:
    """The connected state of one STOMP connection: its subscriptions, the window their
    unacknowledged messages share (``max_unacked_bytes``) and its open transactions."""

    def __init__(self, session: StompPeer, principal: Principal) -> None:
        self.session = session
        self.principal = principal
        self.subscriptions: dict[str, StompSubscription] = {}
        self.window = ByteWindow(session.conn.limits.max_unacked_bytes)
        self.transactions = StompTransactions(session.conn.limits)
        self._ack_ids = itertools.count(1)
        self._handlers: dict[str, Callable[[StompFrame], Awaitable[None]]] = {
            command: getattr(self, f"_{command.lower()}") for command in CONNECTED_COMMANDS}

    async def handle(self, frame: StompFrame) -> None:
        handler = self._handlers.get(frame.command)
        if handler is None:
            raise UnknownOperationError(f"unknown STOMP command {frame.command[:40]!r}")
        transaction = frame.get("transaction") if frame.command in TRANSACTED else None
        if transaction is not None:
            if frame.command == "SEND":  # refused here, before the frame is kept
                topic = Destination.parse(frame.get("destination")).topic
                SEND_ACCESS.check(self.principal, {"topic": topic})
                self.session.topic_quota.check(self.principal, [topic])
            self.transactions.add(transaction, frame)
        else:
            await handler(frame)
        receipt = frame.get("receipt")
        if receipt is not None:
            await self.session.send(StompFrame("RECEIPT", {"receipt-id": receipt}))

    async def _send(self, frame: StompFrame) -> None:
        await self._publish([frame])

    async def _publish(self, frames: list[StompFrame]) -> None:
        """Publish ``frames`` in order, one batch per run of frames to the same destination."""
        for topic, batch in itertools.groupby(frames, lambda f: Destination.parse(f.get("destination")).topic):
            messages = [self._outgoing(f) for f in batch]
            SEND_ACCESS.check(self.principal, {"topic": topic})
            with self.session.topic_quota.naming(self.principal, [topic]):
                placed = await self.session.engine.publish(topic, messages)
            self.session.conn.metrics.published.labels(topic).inc(len(placed))

    @staticmethod
    def _outgoing(frame: StompFrame) -> OutgoingMessage:
        headers = {k: v for k, v in frame.headers.items() if k not in CONTROL_HEADERS}
        return OutgoingMessage(frame.body, headers=headers)

    async def _subscribe(self, frame: StompFrame) -> None:
        destination = Destination.parse(frame.get("destination"))
        sub_id = frame.get("id") or (destination.raw if self.session.version == "1.0" else None)
        if sub_id is None:
            raise MalformedFrameError("SUBSCRIBE needs an id header")
        if sub_id in self.subscriptions:
            raise MalformedFrameError(f"subscription id {sub_id!r} is already in use")
        limits = self.session.conn.limits
        if len(self.subscriptions) >= limits.max_subscriptions:  # each is a group's member, and a task
            raise RequestLimitError(f"this connection holds {len(self.subscriptions)} subscriptions, "
                                    f"max_subscriptions={limits.max_subscriptions}")
        ack_mode = frame.get("ack", "auto")
        if ack_mode not in ACK_MODES:
            raise MalformedFrameError(f"ack mode {ack_mode!r} is not one of {', '.join(ACK_MODES)}")
        prefetch = min(_prefetch(frame.get("activemq.prefetchSize"), limits.stomp_prefetch), limits.max_fetch_messages)
        if destination.kind == "queue":  # the group NAME over topic NAME, as a native subscribe
            QUEUE_ACCESS.check(self.principal, {"group": destination.topic, "topics": [destination.topic]})
        else:  # a broadcasting member of its own: reading the topic, as a native read
            TOPIC_ACCESS.check(self.principal, {"topic": destination.topic})
        broadcast = destination.kind == "topic"
        with (self.session.topic_quota.naming(self.principal, [destination.topic]),
              self.session.quota.joining(self.principal, destination.group)):
            member = await self.session.engine.join(destination.group, [destination.topic],
                                                    broadcast=broadcast, from_end=broadcast)
        await self.session.engine.share_window(member, self.window)
        subscription = StompSubscription(
            sub_id, destination, _mode(ack_mode), prefetch, member, self.session.engine, self._message,
            lambda: f"{self.session.session_id}-{next(self._ack_ids)}",
            self.session.conn.limits)
        self.subscriptions[sub_id] = subscription
        subscription.start(self.session.report_failure)

    async def _message(self, subscription: StompSubscription, delivery: Delivery, ack_id: str) -> None:
        headers = {k: v for k, v in delivery.headers.items() if k not in CONTROL_HEADERS}
        headers.update({
            "destination": subscription.destination.raw, "subscription": subscription.id,
            "message-id": message_id_of(delivery, ack_id), "ack": ack_id, "persistent": "true",
            "redelivered": "true" if delivery.delivery_count > 1 else "false",
        })
        await self.session.send(StompFrame("MESSAGE", headers, delivery.body))
        self.session.conn.metrics.delivered.labels(delivery.topic).inc()

    async def _unsubscribe(self, frame: StompFrame) -> None:
        sub_id = frame.get("id") or frame.get("destination")
        subscription = self.subscriptions.pop(sub_id or "", None)
        if subscription is None:
            raise MalformedFrameError(f"UNSUBSCRIBE: no subscription {sub_id!r}")
        await subscription.stop()

    async def _ack(self, frame: StompFrame) -> None:
        await self._settle(frame, redeliver=False)

    async def _nack(self, frame: StompFrame) -> None:
        await self._settle(frame, redeliver=True)

    async def _settle(self, frame: StompFrame, redeliver: bool) -> None:
        subscription, ack_id = self._find(frame)
        if subscription.ack_mode == "auto":
            return
        await subscription.settle(subscription.select(ack_id), redeliver)

    def _find(self, frame: StompFrame) -> tuple[StompSubscription, str]:
        """The subscription and ack id an ACK/NACK names: ``id`` (1.2) or ``message-id`` (1.0, 1.1)."""
        ack_id = frame.get("id") if self.session.version == "1.2" else None
        message_id = frame.get("message-id")
        named = frame.get("subscription")
        candidates = [self.subscriptions[named]] if named in self.subscriptions else list(
            self.subscriptions.values())
        for subscription in candidates:
            found = ack_id if ack_id in subscription.pending else (
                subscription.ack_id_for(message_id) if message_id else None)
            if found is not None:
                return subscription, found
        raise RequestError(f"{frame.command}: no pending message with id {ack_id or message_id!r}")

    async def _begin(self, frame: StompFrame) -> None:
        self.transactions.begin(frame.get("transaction"))

    async def _commit(self, frame: StompFrame) -> None:
        frames = self.transactions.end(frame.get("transaction"))
        for command, run in itertools.groupby(frames, lambda f: f.command):
            batch = list(run)
            if command == "SEND":
                await self._publish(batch)
            for acknowledgement in batch if command != "SEND" else ():
                await self._settle(acknowledgement, redeliver=command == "NACK")

    async def _abort(self, frame: StompFrame) -> None:
        self.transactions.end(frame.get("transaction"))

    async def _disconnect(self, frame: StompFrame) -> None:
        """Leave every group before the RECEIPT: once the client has it, what it held
        unacknowledged is already back for the other members (the session closes after)."""
        await self.close()

    async def close(self) -> None:
        for subscription in self.subscriptions.values():
            await subscription.stop()
        self.subscriptions.clear()


def _mode(value: str) -> AckMode:
    return next(mode for mode in ACK_MODES if mode == value)


def _prefetch(raw: str | None, default: int) -> int:
    if raw is None:
        return default
    prefetch = parse_number("activemq.prefetchSize", raw, MalformedFrameError)
    if prefetch < 1:
        raise MalformedFrameError(f"header activemq.prefetchSize {raw!r} must be a whole number >= 1")
    return prefetch
