"""`AsyncClient` and `AsyncConsumer`: the broker server's native protocol for asyncio programs.

The calls of `broker.client.Client`, awaited: one connection carries every
request, each with an id, and a reader task resolves each reply's future, so
any number of coroutines pipeline publishes, fetches and acks on it. When the
connection breaks, waiting calls fail with `BrokerUnavailableError` and the
next call connects again; a publish is retried with backoff (tenacity) and
keeps its message ids, so a resend whose first copy reached the store is
dropped by the broker. `AsyncConsumer` is one group member that joins again
after a reconnect (`broker.consumer.Consumer` for threads) and goes on from the group's committed offsets.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from broker.client import (
    ANSWER_TIMEOUT,
    CONNECT_TIMEOUT,
    HELLO_TIMEOUT,
    LEAVE,
    PUBLISH,
    SEND_TIMEOUT,
    parse_address,
    unix_path,
    where,
)
from broker.client_wire import (
    DEFAULT_MAX_WAITING,
    closed_by,
    fitting,
    frame_limit,
    lost,
    publish_requests,
    result,
    waiting_limit,
)
from broker.delivery.values import Delivery, OutgoingMessage, Placement
from broker.errors import BrokerError, BrokerUnavailableError, UnknownMemberError
from broker.protocol import codec as native_codec
from broker.protocol.calls import AsyncCalls
from broker.protocol.codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, decode_body
from broker.protocol.operations import Operation

log = structlog.get_logger("broker.client")
_Link = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class AsyncClient(AsyncCalls):
    """The broker server's calls as coroutines, over one pipelined connection."""

    def __init__(self, address: str, *, user: str | None = None, password: str | None = None,
                 tls: ssl.SSLContext | None = None, publish_retry_seconds: float = 30.0) -> None:
        self.address = parse_address(address)
        self.path = unix_path(address)
        self._name = where(address)
        self._credentials = (user, password)
        self._tls = tls
        self._retry_seconds = publish_retry_seconds
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._link: _Link | None = None
        self._heard = 0  # frames read from the server: a silence is one where it does not move
        self._connecting = asyncio.Lock()
        self._reader_task: asyncio.Task[None] | None = None
        self._closed = False
        self._max_frame_size = DEFAULT_MAX_FRAME_SIZE  # the server's, told at every connect's hello
        self._waiting_slots = asyncio.BoundedSemaphore(DEFAULT_MAX_WAITING)  # likewise


    async def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        """`broker.client.Client.publish`, awaited: resent with backoff under the same ids."""
        async for attempt in self._resending():
            with attempt:
                await self._connected()  # the server's frame limit is known from here on
        placements: list[Placement] = []
        for fields in publish_requests(topic, messages, self._max_frame_size):  # made once: a resend keeps them
            async for attempt in self._resending():
                with attempt:
                    reply = await self._request(PUBLISH, fields)
            placements += PUBLISH.result(reply)
        return placements

    def _resending(self) -> AsyncRetrying:
        """Tries of one publish step, with backoff over reconnects for ``publish_retry_seconds``."""
        return AsyncRetrying(retry=retry_if_exception_type(BrokerUnavailableError),
                             wait=wait_exponential(multiplier=0.05, max=2.0),
                             stop=stop_after_delay(self._retry_seconds), reraise=True)

    async def leave(self, member: str) -> None:
        """`broker.client.Client.leave`: with no connection, its members are gone already."""
        if self._link is None:
            return
        LEAVE.result(await self._request(LEAVE, LEAVE.request((member,), {})))

    async def close(self) -> None:
        self._closed = True
        if self._link is not None:
            self._drop(self._link, ConnectionError("closed by the client"))
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the connection ------------------------------------------------------------

    async def _request(self, op: Operation, fields: Mapping[str, Any]) -> dict[str, Any]:
        link = await self._connected()
        if not op.waits:
            return await self._send(link, op.name, fields)
        async with self._waiting_slots:  # `broker.client_wire.waiting_limit`: the rest wait here
            return await self._send(link, op.name, fields)

    async def _send(self, link: _Link, op: str, fields: Mapping[str, Any], *,
                    hello: bool = False) -> dict[str, Any]:
        request_id = next(self._ids)
        given = {k: v for k, v in fields.items() if v is not None}  # absent: the server's default
        frame = fitting(native_codec.encode({"id": request_id, "op": op, **given}), op, self._max_frame_size)
        waiting = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiting
        try:
            link[1].write(frame)
            await asyncio.wait_for(link[1].drain(), SEND_TIMEOUT)  # a server reading nothing: lost
        except OSError as exc:  # TimeoutError is an OSError
            self._drop(link, exc)
        return result(await (self._greeted(link, waiting) if hello else self._awaited(link, waiting)))

    async def _greeted(self, link: _Link, waiting: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
        """`broker.client.Client._greeted`: the hello's reply, waited for without pings up to
        `HELLO_TIMEOUT` (the server reads no ping before it has checked the hello)."""
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), ANSWER_TIMEOUT)
        except TimeoutError:
            log.info("client.hello_slow", broker=self._name, waited=ANSWER_TIMEOUT)
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), max(HELLO_TIMEOUT - ANSWER_TIMEOUT, 0.0))
        except TimeoutError:
            self._drop(link, TimeoutError(f"no answer to the hello in {HELLO_TIMEOUT} s"))
            return await waiting

    async def _awaited(self, link: _Link, waiting: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
        """`broker.client.Client._awaited`: the reply, however late, while the server answers a
        ping after `ANSWER_TIMEOUT` of silence; the connection dropped once it does not."""
        while True:
            heard = self._heard
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), ANSWER_TIMEOUT)
            except TimeoutError:
                if self._heard == heard and not await self._answers(link):
                    self._drop(link, TimeoutError(f"no answer in {ANSWER_TIMEOUT} s, not even to a ping"))

    async def _answers(self, link: _Link) -> bool:
        """Whether the server on ``link`` answers a ping within `ANSWER_TIMEOUT` (a refusal too)."""
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        try:
            link[1].write(native_codec.encode({"id": request_id, "op": "ping"}))
            await asyncio.wait_for(asyncio.shield(answer), ANSWER_TIMEOUT)
            return True
        except (OSError, BrokerUnavailableError):  # TimeoutError is an OSError
            return False
        finally:
            self._waiting.pop(request_id, None)

    async def _connected(self) -> _Link:
        async with self._connecting:
            if self._closed:
                raise BrokerError("this broker client is closed")
            if self._link is not None:
                return self._link
            host, port = self.address
            hostname = host if self._tls else None
            opening = (asyncio.open_unix_connection(self.path, ssl=self._tls, server_hostname=hostname)
                       if self.path is not None else
                       asyncio.open_connection(host, port, ssl=self._tls, server_hostname=hostname))
            try:
                link = await asyncio.wait_for(opening, CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                raise BrokerUnavailableError(f"broker {self._name} unreachable: {exc}") from exc
            self._link = link
            self._reader_task = asyncio.create_task(self._read(link), name="broker-client-reader")
            user, password = self._credentials  # a hello even without a user: it tells the frame limit
            hello = await self._send(link, "hello", {"user": user, "password": password}, hello=True)
            self._max_frame_size = frame_limit(hello)
            self._waiting_slots = asyncio.BoundedSemaphore(waiting_limit(hello))
            return link

    async def _read(self, link: _Link) -> None:
        decoder = FrameDecoder(1 << 30)
        refusal = ""  # the server's error for no request, sent before it closes (an RST may follow)
        first = b""  # what the peer sent first: named where it is not the native protocol
        try:
            while data := await link[0].read(1 << 20):
                first = first or data
                for payload in decoder.feed(data):
                    self._heard += 1
                    reply = decode_body(payload)
                    waiting = self._waiting.pop(reply.get("id", 0), None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(reply)
                    elif not reply.get("ok", True):  # an error for no request: the server ends
                        log.warning("client.refused", error=reply.get("error"))
                        refusal = closed_by(reply)
            raise ConnectionError("the broker closed the connection")
        except Exception as exc:  # noqa: BLE001 - every waiter learns the connection is gone
            exc = ConnectionError(refusal) if refusal else exc
            self._drop(link, exc, first)

    def _drop(self, link: _Link, exc: BaseException, first: bytes = b"") -> None:
        if self._link is link:
            self._link = None
        link[1].transport.abort()
        for request_id in list(self._waiting):
            waiting = self._waiting.pop(request_id)
            if not waiting.done():
                waiting.set_exception(lost(self._name, exc, first))


class AsyncConsumer:
    """One member of ``group`` over ``topics`` that joins again whenever its connection was lost.

    The server lets a member go with its connection, so its unacknowledged
    messages go to other members (or back to this one, joined again); acks
    for deliveries of a member that is gone are dropped, since those
    messages are delivered again.
    """

    def __init__(self, client: AsyncClient, group: str, topics: Sequence[str], *,
                 reconnect_seconds: float = 30.0, **join_options: Any) -> None:
        self.client = client
        self.group = group
        self.topics = list(topics)
        self._options = join_options
        self._reconnect_seconds = reconnect_seconds
        self._member: str | None = None
        self._holders: dict[str, str] = {}  # receipt -> the member it was delivered to

    async def fetch(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages``; on a lost connection, reconnect and rejoin (with backoff) first."""
        async for attempt in self._retrying():
            with attempt:
                member = await self._joined()
                try:
                    got = await self.client.fetch(member, max_messages, timeout)
                except (BrokerUnavailableError, UnknownMemberError):
                    self._member = None
                    raise BrokerUnavailableError(f"member of {self.group!r} lost") from None
        self._holders.update({d.receipt: member for d in got})
        return got

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """STANDARD for the deliveries this member still holds (others come back anyway)."""
        await self._settle(deliveries, self.client.ack)

    async def nack(self, deliveries: Sequence[Delivery], delay: float) -> None:
        await self._settle(deliveries, lambda m, r: self.client.nack(m, r, delay))

    async def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> None:
        await self._settle(deliveries, lambda m, r: self.client.dead_letter(m, r, reason))

    async def close(self) -> None:
        if self._member is not None:
            try:
                await self.client.leave(self._member)
            except (BrokerUnavailableError, UnknownMemberError):
                pass
            self._member = None

    async def _settle(self, deliveries: Sequence[Delivery], call: Any) -> None:
        receipts = [d.receipt for d in deliveries if self._holders.pop(d.receipt, None) == self._member]
        if receipts and self._member is not None:
            try:
                await call(self._member, receipts)
            except (BrokerUnavailableError, UnknownMemberError):
                self._member = None  # they are delivered again; the next fetch rejoins

    async def _joined(self) -> str:
        if self._member is None:
            self._member = await self.client.join(self.group, self.topics, **self._options)
            log.info("client.joined", group=self.group, member=self._member)
        return self._member

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(retry=retry_if_exception_type(BrokerUnavailableError),
                             wait=wait_exponential(multiplier=0.05, max=2.0),
                             stop=stop_after_delay(self._reconnect_seconds), reraise=True)
