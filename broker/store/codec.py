"""The on-disk frame of one record: a fixed binary header, CRC32C, then the variable fields.

Layout (little endian)::

    magic u16 | crc32c u32 | length u32 | version u8 | queue u32 | queue_offset u64
    | store_time f64 | attempt u32 | len(topic) u16 | len(id) u16 | len(key) u16
    | len(tag) u16 | len(headers) u32 | len(body) u32 | topic | id | key | tag | headers | body

``length`` counts the bytes from itself to the end of the body, and the CRC
covers exactly those bytes, so a torn length is caught as surely as a torn body.
Headers are a msgpack map of str to str (never pickle). Zero-filled space fails
the magic check, so a zero tail reads as "no more records".
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgpack
from crc32c import crc32c

from broker.store.record import NO_HEADERS, StoredMessage

MAGIC = 0xB7E5
VERSION = 1
PREFIX = struct.Struct("<HI")
HEADER = struct.Struct("<IBIQdIHHHHII")
FRAME_MIN = PREFIX.size + HEADER.size
MAGIC_BYTES = struct.pack("<H", MAGIC)


class FrameError(ValueError):
    """A frame that is not a valid record (internal: callers name the file and offset)."""


def encode(
    topic: bytes,
    queue: int,
    queue_offset: int,
    store_time: float,
    attempt: int,
    message_id: bytes,
    key: bytes,
    tag: bytes,
    headers: bytes,
    body: bytes,
) -> bytes:
    """One complete frame; fields are already encoded to bytes."""
    length = (
        HEADER.size + len(topic) + len(message_id) + len(key) + len(tag) + len(headers) + len(body)
    )
    payload = b"".join((
        HEADER.pack(
            length, VERSION, queue, queue_offset, store_time, attempt, len(topic),
            len(message_id), len(key), len(tag), len(headers), len(body),
        ),
        topic, message_id, key, tag, headers, body,
    ))
    return PREFIX.pack(MAGIC, crc32c(payload)) + payload


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """Headers as a msgpack map; empty headers take no space."""
    return msgpack.packb(dict(headers), use_bin_type=True) if headers else b""


def check(buf: Any, pos: int, max_size: int) -> tuple[int, ...] | None:
    """Validate the frame at ``pos``: its header fields, or None if ``buf`` ends inside it.

    Raises `FrameError` if the bytes there are not a valid frame.
    """
    if pos + FRAME_MIN > len(buf):
        if bytes(buf[pos : pos + 2]) not in (MAGIC_BYTES[: len(buf) - pos], b""):
            raise FrameError("bad magic")
        return None
    magic, crc = PREFIX.unpack_from(buf, pos)
    if magic != MAGIC:
        raise FrameError("bad magic")
    fields = HEADER.unpack_from(buf, pos + PREFIX.size)
    length = fields[0]
    if length < HEADER.size or length + PREFIX.size > max_size:
        raise FrameError(f"bad length {length}")
    end = pos + PREFIX.size + length
    if end > len(buf):
        return None
    if crc32c(memoryview(buf)[pos + PREFIX.size : end]) != crc:
        raise FrameError("CRC mismatch")
    if fields[1] != VERSION:
        raise FrameError(f"unknown version {fields[1]}")
    if HEADER.size + sum(fields[6:]) != length:
        raise FrameError("field lengths do not add up")
    return fields


def decode(buf: Any, pos: int, fields: tuple[int, ...], log_offset: int) -> StoredMessage:
    """The full message of a frame already validated by `check`."""
    p = pos + FRAME_MIN
    tl, il, kl, gl, hl, bl = fields[6:12]
    view = memoryview(buf)
    q = p + tl + il + kl + gl
    try:
        return StoredMessage(
            str(view[p : p + tl], "utf-8"),
            fields[2],
            fields[3],
            log_offset,
            str(view[p + tl : p + tl + il], "utf-8"),
            str(view[p + tl + il : p + tl + il + kl], "utf-8"),
            str(view[p + tl + il + kl : q], "utf-8") if gl else "",
            MappingProxyType(msgpack.unpackb(view[q : q + hl], raw=False)) if hl else NO_HEADERS,
            bytes(view[q + hl : q + hl + bl]),
            fields[4],
            fields[5],
        )
    except (UnicodeDecodeError, ValueError, msgpack.UnpackException) as exc:
        raise FrameError(f"undecodable fields: {exc}") from exc
