"""Values shared by the framework and every backend: messages, queue refs, failures."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, NamedTuple

import msgpack
from pydantic_core import to_jsonable_python
from typing_extensions import TypeVar

from backends.errors import BodyDecodeError

_UNDECODED = object()
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))  # version and variant bits
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)  # version 4, RFC 4122 variant
CONTENT_TYPE = "content-type"
SUMMARY_LIMIT = 8192
"""Characters of a failure's message and of its traceback a transport's dead-letter copy keeps."""
JSON = "application/json"
MSGPACK = "application/msgpack"


class QueueRef(NamedTuple):
    """One queue of a topic: the unit offsets are kept for (a tuple: hashed and compared in C,
    as every message's offset bookkeeping does)."""

    topic: str
    queue: int


def new_message_id() -> str:
    """A message id for a producer that gave none: a random uuid4, in hex.

    Built from the random bits directly: ``uuid.uuid4().hex`` costs several
    times more, and publishing pays it for every message.
    """
    value = int.from_bytes(os.urandom(16), "big") & _UUID4_CLEAR | _UUID4_SET
    return f"{value:032x}"


def text_from_bytes(raw: bytes) -> str:
    """Text read from bytes another program wrote (a Kafka key or header value): UTF-8, each byte
    that is not kept as a lone surrogate (PEP 383's ``surrogateescape``), so distinct bytes stay
    distinct text and `text_bytes` gives back exactly the bytes that came."""
    return raw.decode("utf-8", "surrogateescape")


def text_bytes(text: str) -> bytes:
    """The bytes ``text`` stands for: its UTF-8, or the bytes `text_from_bytes` read it from."""
    return text.encode("utf-8", "surrogateescape")


def not_text(value: str) -> bool:
    """Whether ``value`` holds a lone surrogate (a byte that was not UTF-8, `text_from_bytes`):
    it has no UTF-8 form, so no text column or text protocol can carry it."""
    return not value.isascii() and any("\ud800" <= char <= "\udfff" for char in value)


def storable(text: str) -> bool:
    """Whether every store's text column holds ``text`` as it is: no NUL (PostgreSQL refuses
    it) and no byte that was not UTF-8 (`not_text`)."""
    return "\x00" not in text and not not_text(text)


def readable(text: str) -> str:
    """``text`` with what a text column or a terminal cannot hold written out: a NUL as ``\\x00``,
    a byte that was not UTF-8 as ``\\xNN`` (any other lone surrogate as ``\\udNNN``)."""
    text = text.replace("\x00", "\\x00")
    if not not_text(text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class OutgoingMessage:
    """A message to publish: the body is already encoded to bytes."""

    payload: bytes
    key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0
    message_id: str | None = None


B = TypeVar("B", default=Any)
"""The type of a typed handler's body (`Message[Order]`); Any for every other message."""


@dataclass(frozen=True)
class Message(Generic[B]):
    """A delivered message. Immutable; ``attempt`` is the transport's delivery count.

    ``queue`` and ``offset`` are the message's place where the transport has one
    (-1 where it has none); ``receipt`` is the transport's own handle for
    acknowledging it, opaque to everyone else. ``unreadable`` says why the
    transport could not read the message as another program wrote it (a field
    missing or not UTF-8): the pipeline dead-letters it with that reason.

    ``payload`` holds the bytes exactly as published; ``body`` decodes them
    (JSON, or msgpack when the ``content-type`` header says so) on first use.
    ``Message[Order]`` is the annotation of a handler that wants the envelope
    with ``body`` validated into ``Order`` (see `with_body`).
    """

    id: str
    topic: str
    queue: int
    offset: int
    payload: bytes
    key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    attempt: int = 1
    published_at: float = 0.0
    first_failure_at: float | None = None
    receipt: str | None = None  # a transport's own handle for ack/nack, opaque to everyone else
    unreadable: str | None = None  # why the transport could not read it as written: it is poison

    @property
    def ref(self) -> QueueRef:
        return QueueRef(self.topic, self.queue)

    @property
    def body(self) -> Any:
        # cached by hand: functools.cached_property takes a lock per access on Python 3.11
        cached = self.__dict__.get("_body", _UNDECODED)
        if cached is _UNDECODED:
            cached = self.__dict__["_body"] = decode_body(self.payload, self.headers.get(CONTENT_TYPE, JSON))
        return cached

    def with_body(self, body: Any) -> Message[Any]:
        """This message with ``body`` in place of the decoded payload (a typed handler's view);
        the payload, which is what is stored and acknowledged, is unchanged."""
        typed: Message[Any] = replace(self)
        typed.__dict__["_body"] = body
        return typed


@dataclass(frozen=True)
class Failure:
    """Why a message became poison: the error and its history."""

    error_type: str
    error_message: str
    traceback: str
    attempts: int
    first_failure_at: float
    last_failure_at: float

    def summary(self, limit: int = SUMMARY_LIMIT) -> Failure:
        """This failure with its message (its start) and traceback (its end: where the error was
        raised) cut to ``limit`` characters each, saying how much was cut: what a transport's
        dead-letter copy carries in its headers, which every wire bounds (AMQP's frame_max,
        JetStream's 64 KiB). The store's dead-letter record keeps the whole failure."""
        message, trace = self.error_message, self.traceback
        if len(message) > limit:
            message = f"{message[:limit]}... [{len(message) - limit} characters cut]"
        if len(trace) > limit:
            trace = f"[{len(trace) - limit} characters cut] ...{trace[-limit:]}"
        return replace(self, error_message=message, traceback=trace)


@dataclass(frozen=True)
class DeadLetter:
    """A dead-letter record: the original message, unchanged, with its failure."""

    group: str
    message: Message
    token: str | None
    failure: Failure
    id: int | None = None
    replays: int = 0
    body_size: int | None = None
    """The whole body's bytes when ``message.payload`` holds only its first bytes (a listing,
    `Store.dead_letters` with ``body_limit``): such a letter is for reading, never replayed."""


def encode_body(body: Any, content_type: str = JSON) -> bytes:
    """Encode a body for the wire; bytes pass through unchanged. Pydantic models, dataclasses,
    datetimes and UUIDs are encoded as their JSON form (pydantic's ``to_jsonable_python``)."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    if not isinstance(body, str | int | float | bool | list | dict | type(None)):
        body = to_jsonable_python(body)
    if content_type == MSGPACK:
        return msgpack.packb(body, use_bin_type=True)
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def decode_body(payload: bytes, content_type: str = JSON) -> Any:
    """Decode a payload; a failure is a `BodyDecodeError` naming the cause."""
    try:
        if content_type == MSGPACK:
            return msgpack.unpackb(payload, raw=False)
        return json.loads(payload)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        preview = payload[:60]
        raise BodyDecodeError(f"cannot decode {content_type} body {preview!r}: {exc}") from exc
