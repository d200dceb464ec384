"""What the broker clients (`broker.client`, `broker.async_client`) put on the wire and read off it.

A publish split into requests that fit the server's frame limit, named by a batch id or an id per
message; the limits a server's hello tells; a reply turned into its value or the error it names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from broker import errors
from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerError, BrokerUnavailableError, NotABrokerError, RecordTooLargeError
from broker.protocol.codec import DEFAULT_MAX_FRAME_SIZE
from broker.protocol.errors import WIRE_ERRORS, ClientError, FrameTooLargeError, ProtocolError
from broker.protocol.tables import outgoing_table

DEFAULT_MAX_WAITING = 64
"""The server's ``max_waiting_requests`` when its hello does not tell it."""
FRAME_RESERVE = 256
"""Bytes of a publish frame besides its messages: prefix, request id, operation, topic, batch id."""


def publish_fields(topic: str, messages: Sequence[OutgoingMessage]) -> dict[str, Any]:
    """A publish request's fields. Messages without ids of their own are named by one batch id
    (128 random bits): the broker gives them the ids ``<batch id>.0``, ``<batch id>.1``, ...
    and drops a resend of the batch id as a whole, with one entry per batch where an id per
    message would take one each. If any message has an id, every one is named by its own (one
    made here where none was given)."""
    if any(message.message_id for message in messages):
        return {"topic": topic, "messages": outgoing_table(messages, message_ids(messages))}
    return {"topic": topic, "messages": outgoing_table(messages, None), "batch": os.urandom(16).hex()}


def publish_requests(topic: str, messages: Sequence[OutgoingMessage], max_frame_size: int) -> list[dict[str, Any]]:
    """The fields of one publish request per run of ``messages`` (in order) that fits in a frame
    of ``max_frame_size`` bytes: the server closes the connection on a larger one, which would
    look like an outage and be resent forever. A message too large for any frame is refused."""
    runs: list[list[OutgoingMessage]] = [[]]
    size = 0
    for message in messages:
        need = framed_size(message)
        if need + FRAME_RESERVE > max_frame_size:
            raise RecordTooLargeError(
                f"message {message.message_id or '(no id)'} of {len(message.body)} bytes takes about {need} "
                f"bytes framed, above the broker server's max_frame_size={max_frame_size}")
        if runs[-1] and size + need + FRAME_RESERVE > max_frame_size:
            runs.append([])
            size = 0
        runs[-1].append(message)
        size += need
    return [publish_fields(topic, run) for run in runs]


def framed_size(message: OutgoingMessage) -> int:
    """At most the bytes ``message`` adds to a publish frame: msgpack gives each value a prefix
    of at most 5 bytes, and a column its message's share of the field names."""
    texts = [message.key, message.tag, message.message_id, *message.headers, *message.headers.values()]
    return len(message.body) + sum(len(t.encode("utf-8", "surrogatepass")) + 5 for t in texts) + 64


def fitting(frame: bytes, op: str, max_frame_size: int) -> bytes:
    """``frame``, unless it is larger than the server takes (it would close the connection)."""
    if len(frame) > max_frame_size:
        raise FrameTooLargeError(f"{op} request of {len(frame)} bytes is above the broker server's "
                                 f"max_frame_size={max_frame_size}")
    return frame


def frame_limit(hello: Mapping[str, Any]) -> int:
    """The frame limit a server's hello reply tells (servers before it: the default)."""
    limit = hello.get("max_frame_size")
    return limit if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_FRAME_SIZE


def waiting_limit(hello: Mapping[str, Any]) -> int:
    """How many requests that wait (fetch, read, ...) the server runs at once per connection, as
    its hello reply tells (servers before it: their default). A client sends no more at once:
    the server refuses one more (`limit_exceeded`), so a process with more members than that
    (a worker with many handlers) would see fetches fail instead of taking turns."""
    limit = hello.get("max_waiting_requests")
    return limit if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_WAITING


def message_ids(messages: Sequence[OutgoingMessage]) -> list[str]:
    """The id of each message: its own, or one made here (128 random bits, as ``uuid4().hex``)."""
    given = [m.message_id for m in messages]
    unnamed = given.count("")
    if not unnamed:
        return given
    made = os.urandom(16 * unnamed).hex()  # one system call for the batch
    fresh = [made[start:start + 32] for start in range(0, len(made), 32)]
    if unnamed == len(given):
        return fresh
    fresh.reverse()
    return [message_id or fresh.pop() for message_id in given]


def closed_by(reply: dict[str, Any]) -> str:
    """What a connection ended with, from the error the server sent for no request before closing
    it (a connection limit, a broken stream)."""
    error = reply.get("error") or {}
    return f"the broker closed the connection: {error.get('code')}: {error.get('message')}"


def result(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok"):
        return reply
    error = reply.get("error") or {}
    kind = getattr(errors, str(error.get("type")), None)
    message = str(error.get("message", "unknown error"))
    if isinstance(kind, type) and issubclass(kind, BrokerError) and kind.__module__ == "broker.errors":
        raise kind(message)
    code = str(error.get("code", "server_error"))
    wire = WIRE_ERRORS.get(code)
    raise wire.from_wire(message, error) if wire is not None else ClientError(code, message)


def lost(where: str, exc: BaseException, first: bytes) -> BrokerError:
    """What each call waiting on a lost connection raises: a `NotABrokerError` where the peer's
    bytes (``first``: what it sent first) did not read as native frames, which no reconnect can
    mend (a STOMP port answers a hello with ``ERROR``), else a `BrokerUnavailableError`, retried."""
    if isinstance(exc, ProtocolError):
        return NotABrokerError(f"{where} does not answer in the broker's native protocol ({exc}); it sent "
                               f"{first[:24]!r} first: is it the broker's STOMP port, or another server?")
    return BrokerUnavailableError(f"broker {where} lost: {exc}")
