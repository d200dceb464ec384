"""`Client`: the broker server's `BrokerApi` for Python programs, over the native protocol.

One TCP connection (TLS when given a context) carries every call of the
client: each request has an id, a reader thread hands each reply to the call
waiting for it, so a long-poll fetch of one thread never holds up another
thread's ack (see broker/PROTOCOL.md). Group members belong to the
connection: when it breaks, the server lets them go (their unacknowledged
messages go to other members), calls fail with `BrokerUnavailableError`, and
the next call connects again. A publish is retried with backoff (tenacity)
over reconnects: a publish names its messages by one batch id when none has
an id, else by an id per message (one made where the caller gave none), and
a resend keeps them, so one whose first copy did reach the store is dropped
by the broker's de-duplication.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import structlog
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    wait_exponential,
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
from broker.delivery.values import OutgoingMessage, Placement
from broker.errors import BrokerError, BrokerUnavailableError
from broker.protocol import codec as native_codec
from broker.protocol.calls import SyncCalls
from broker.protocol.codec import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, decode_body
from broker.protocol.operations import OPERATIONS, Operation
from broker.tls_socket import TlsSocket

Connection = socket.socket | TlsSocket
"""A plain socket, or TLS over one."""

log = structlog.get_logger("broker.client")
PUBLISH = OPERATIONS["publish"]
LEAVE = OPERATIONS["unsubscribe"]
CONNECT_TIMEOUT = 5.0
ANSWER_TIMEOUT = CONNECT_TIMEOUT
"""Seconds the connection may stay silent while a reply is owed before the client pings the
server, and then waits for its answer: a server that answers nothing, not even a ping, in the
time a connection may take to be made (a hung process, a partition dropping packets) is as
unreachable as one that refuses the connection. A reply that is slow to come (a long poll, a long
replay) is waited for as long as the server answers pings."""
SEND_TIMEOUT = 2 * ANSWER_TIMEOUT
"""Seconds a send may go without the server taking a byte (its buffers full: it reads nothing)
before the connection is given up: as long as a silence and an unanswered ping. A send lock
held for ever would keep every other call of the client, its pings too, from the connection."""
HELLO_TIMEOUT = 30.0
"""Seconds a hello may wait for its answer. The server reads nothing behind a hello until it has
checked the password (a slow hash, other log-ins waiting their turn under load), so a ping
cannot be answered before: the hello is waited for in silence, up to this bound, as Kafka bounds
a connection's setup (``socket.connection.setup.timeout.ms``) apart from its requests. Past the
bound the server is taken as hung (`BrokerUnavailableError` naming the hello)."""


def unix_path(address: str) -> str | None:
    """The socket path of ``unix:///path/broker.sock`` (or a bare ``/path``), else None."""
    if address.startswith("unix://"):
        return address.removeprefix("unix://")
    return address if address.startswith("/") else None


def where(address: str) -> str:
    """How log lines and errors name the broker at ``address``."""
    path = unix_path(address)
    return path if path is not None else "{}:{}".format(*parse_address(address))


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``reliable://host:port``) as a pair; a `BrokerError` naming it if not."""
    if unix_path(address) is not None:
        return "localhost", 0
    rest = address.partition("://")[2] if "://" in address else address
    host, _, port = rest.split("/")[0].split("?")[0].rpartition(":")
    if not host or not port.isdigit():
        raise BrokerError(f"broker address {address!r}: expected host:port")
    return host, int(port)


class Client(SyncCalls):
    """A `BrokerApi` over one pipelined connection to a broker server."""

    def __init__(self, address: str, *, user: str | None = None, password: str | None = None,
                 tls: ssl.SSLContext | None = None, publish_retry_seconds: float = 30.0) -> None:
        self.address = parse_address(address)
        self.path = unix_path(address)
        self._credentials = (user, password)
        self._tls = tls
        self._retry_seconds = publish_retry_seconds
        self._name = where(address)
        self._lock = threading.Lock()
        self._connecting = threading.Lock()  # held from a connect through its hello
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future[dict[str, Any]]] = {}
        self._sock: Connection | None = None
        self._heard = 0  # frames read from the server: a silence is one where it does not move
        self._closed = False
        self._refused = ""  # what the server said when it refused the connection last open
        self._max_frame_size = DEFAULT_MAX_FRAME_SIZE  # the server's, told at every connect's hello
        self._waiting_slots = threading.BoundedSemaphore(DEFAULT_MAX_WAITING)  # likewise

    # -- BrokerApi: one method per operation (SyncCalls), publish resent over reconnects ------


    def publish(self, topic: str, messages: Sequence[OutgoingMessage], *,
                timeout: float | None = None) -> list[Placement]:
        """Append ``messages`` to ``topic``; resent with backoff over reconnects, under the same
        ids or batch id, so a resend whose first copy reached the store is dropped.

        ``timeout``: seconds the whole call may take (a caller's own bound), its connect, hello
        and replies included; past it, `BrokerUnavailableError`. None: ``publish_retry_seconds``
        of resends, each reply waited for as long as the server answers pings."""
        until = None if timeout is None else time.monotonic() + timeout
        for attempt in self._resending(until):
            with attempt:
                self._connected(until)  # the server's frame limit is known from here on
        placements: list[Placement] = []
        for fields in publish_requests(topic, messages, self._max_frame_size):  # made once: a resend keeps them
            for attempt in self._resending(until):
                with attempt:
                    reply = self._request(PUBLISH, fields, until)
            placements += PUBLISH.result(reply)
        return placements

    def leave(self, member: str) -> None:
        """End ``member``. A member belongs to the connection it joined on: with none (lost), the
        server has let it go already, and no connection is made (to a hung server, a hello's wait)
        only to be told so."""
        with self._lock:
            if self._sock is None:
                return
        LEAVE.result(self._request(LEAVE, LEAVE.request((member,), {})))

    def _resending(self, until: float | None = None) -> Retrying:
        """Tries of one publish step, with backoff over reconnects for ``publish_retry_seconds``
        and, where given, until the monotonic time ``until``."""
        def spent(state: RetryCallState) -> bool:
            return ((state.seconds_since_start or 0.0) >= self._retry_seconds
                    or (until is not None and time.monotonic() >= until))

        return Retrying(retry=retry_if_exception_type(BrokerUnavailableError),
                        wait=wait_exponential(multiplier=0.05, max=2.0), stop=spent, reraise=True)

    def close(self) -> None:
        """End the connection now: the server sees it end and releases what this client held.

        ``shutdown`` comes first: closing a socket another thread is blocked in
        ``recv()`` on neither wakes that thread nor sends FIN on Linux, so the
        server would keep the connection until ``idle_timeout`` and its members'
        messages until the session timeout.
        """
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already gone
                pass
            sock.close()

    # -- the connection ------------------------------------------------------------

    def _request(self, op: Operation, fields: Mapping[str, Any], until: float | None = None) -> dict[str, Any]:
        """One request's reply; where ``until`` is given, a `BrokerUnavailableError` once that
        monotonic time has passed without it."""
        if not op.waits:
            return self._exchange(self._connected(until), op.name, fields, until=until)
        self._connected(until)  # the server's limit is known from here on
        with self._waiting_slots:  # more would be refused (limit_exceeded): the rest wait here
            return self._exchange(self._connected(until), op.name, fields, until=until)

    def _exchange(self, sock: Connection, op: str, fields: Mapping[str, Any], *,
                  hello: bool = False, until: float | None = None) -> dict[str, Any]:
        """Send one request on ``sock`` and wait for its reply (a ``hello``'s: `_greeted`)."""
        request_id = next(self._ids)
        given = {k: v for k, v in fields.items() if v is not None}  # absent: the default
        frame = fitting(native_codec.encode({"id": request_id, "op": op, **given}), op, self._max_frame_size)
        waiting: Future[dict[str, Any]] = Future()
        self._waiting[request_id] = waiting
        try:
            with self._send_lock:
                sock.sendall(frame)
        except OSError as exc:  # closed under it by the reader, which may have read why first
            self._waiting.pop(request_id, None)
            self._lost(sock, exc)
            raise BrokerUnavailableError(f"broker {self._where()} unreachable: {self._refused or exc}") from exc
        if hello:
            return result(self._greeted(sock, waiting, until))
        try:
            return result(self._awaited(sock, waiting, until))
        finally:
            self._waiting.pop(request_id, None)  # given up at ``until``: a late reply is dropped

    def _greeted(self, sock: Connection, waiting: Future[dict[str, Any]], until: float | None) -> dict[str, Any]:
        """The hello's reply, waited for without pings (`HELLO_TIMEOUT`, or until ``until``); the
        connection given up if none comes by then."""
        bound = HELLO_TIMEOUT if until is None else max(min(HELLO_TIMEOUT, until - time.monotonic()), 0.0)
        try:
            return waiting.result(min(ANSWER_TIMEOUT, bound))
        except TimeoutError:
            log.info("client.hello_slow", broker=self._where(), waited=min(ANSWER_TIMEOUT, bound))
        try:
            return waiting.result(max(bound - ANSWER_TIMEOUT, 0.0))
        except TimeoutError:
            self._lost(sock, TimeoutError(f"no answer to the hello in {bound:.3g} s"))
            return waiting.result()

    def _awaited(self, sock: Connection, waiting: Future[dict[str, Any]], until: float | None) -> dict[str, Any]:
        """The reply ``waiting`` stands for, however late, while the server on ``sock`` is there
        (and ``until`` has not passed); a `BrokerUnavailableError` once it answers nothing
        (`ANSWER_TIMEOUT`): the connection is given up then, every call on it fails and the next
        one connects again."""
        while True:
            heard = self._heard
            left = ANSWER_TIMEOUT if until is None else until - time.monotonic()
            try:
                return waiting.result(max(min(ANSWER_TIMEOUT, left), 0.0))
            except TimeoutError:
                if left <= ANSWER_TIMEOUT and until is not None:  # the caller's bound is spent
                    raise BrokerUnavailableError(f"broker {self._where()}: no reply within the caller's "
                                                 "timeout") from None
                if self._heard == heard and not self._answers(sock, until):
                    self._lost(sock, TimeoutError(f"no answer in {ANSWER_TIMEOUT} s, not even to a ping"))

    def _answers(self, sock: Connection, until: float | None = None) -> bool:
        """Whether the server on ``sock`` answers a ping within `ANSWER_TIMEOUT` (and before
        ``until``; a refusal is an answer too)."""
        request_id = next(self._ids)
        answer: Future[dict[str, Any]] = Future()
        self._waiting[request_id] = answer
        try:
            with self._send_lock:
                sock.sendall(native_codec.encode({"id": request_id, "op": "ping"}))
            answer.result(ANSWER_TIMEOUT if until is None else max(min(ANSWER_TIMEOUT, until - time.monotonic()), 0.0))
            return True
        except (OSError, BrokerUnavailableError):  # TimeoutError is an OSError
            return False
        finally:
            self._waiting.pop(request_id, None)

    def _connected(self, until: float | None = None) -> Connection:
        """The connection, made and greeted first if there is none: calls of other threads wait
        for its hello, so none reaches the server before it (until ``until``, if given)."""
        if not self._connecting.acquire(timeout=-1 if until is None else max(until - time.monotonic(), 0.0)):
            raise BrokerUnavailableError(f"broker {self._where()}: still connecting at the caller's timeout")
        try:
            with self._lock:
                if self._closed:
                    raise BrokerError("this broker client is closed")
                if self._sock is not None:
                    return self._sock
                try:
                    sock = self._open()
                except OSError as exc:
                    raise BrokerUnavailableError(f"broker {self._where()} unreachable: {exc}") from exc
                sock.settimeout(None)
                self._sock, self._refused = sock, ""
                threading.Thread(target=self._read, args=(sock,), name="broker-client", daemon=True).start()
            user, password = self._credentials  # a hello even without a user: it tells the frame limit
            hello = self._exchange(sock, "hello", {"user": user, "password": password}, hello=True, until=until)
            self._max_frame_size = frame_limit(hello)
            self._waiting_slots = threading.BoundedSemaphore(waiting_limit(hello))
            return sock
        finally:
            self._connecting.release()

    def _open(self) -> Connection:
        if self.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(CONNECT_TIMEOUT)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # the kernel's own bound on a blocking send without progress (settimeout(None) keeps it)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT), 0))
        if self._tls is None:
            return sock
        try:
            return TlsSocket(sock, self._tls, self.address[0])  # read and written by two threads at once
        except BaseException:
            sock.close()
            raise

    def _read(self, sock: Connection) -> None:
        decoder = FrameDecoder(1 << 30)
        refusal = ""  # the server's error for no request, sent before it closes (an RST may follow)
        first = b""  # what the peer sent first: named where it is not the native protocol
        try:
            while data := sock.recv(1 << 20):
                first = first or data
                for payload in decoder.feed(data):
                    self._heard += 1
                    reply = decode_body(payload)
                    waiting = self._waiting.pop(reply.get("id", 0), None)
                    if waiting is not None:
                        waiting.set_result(reply)
                    elif not reply.get("ok", True):  # an error for no request: the server ends
                        log.warning("client.refused", error=reply.get("error"))
                        refusal = self._refused = closed_by(reply)
            raise ConnectionError("the broker closed the connection")
        except Exception as exc:  # noqa: BLE001 - every waiter learns the connection is gone
            exc = ConnectionError(refusal) if refusal else exc
            self._lost(sock, exc, first)

    def _lost(self, sock: Connection, exc: BaseException, first: bytes = b"") -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
        sock.close()
        for request_id in list(self._waiting):
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_exception(lost(self._where(), exc, first))

    def _where(self) -> str:
        return self._name

