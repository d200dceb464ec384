"""The native protocol's frame: a length prefix, a version byte, a msgpack body.

Layout (big endian, see broker/PROTOCOL.md)::

    length u32 | version u8 | body (length - 1 bytes of msgpack)

``length`` counts the version byte and the body. The decoder is incremental:
`FrameDecoder.feed` takes whatever chunk the socket gave and returns the
frames it completed. It refuses a frame from its length prefix alone, so an
oversized frame's body is never buffered.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from broker.protocol.errors import (
    BrokenStreamError,
    FrameTooLargeError,
    MalformedFrameError,
    UnsupportedVersionError,
)

VERSION = 2  # 2: lists of messages travel as tables, column by column (broker.protocol.tables)
PREFIX = struct.Struct(">IB")
DEFAULT_MAX_FRAME_SIZE = 8 * 1024 * 1024


def encode(body: Mapping[str, Any], version: int = VERSION) -> bytes:
    """One complete frame carrying ``body`` (a map; bytes travel as msgpack bin)."""
    payload = msgpack.packb(dict(body), use_bin_type=True)
    return PREFIX.pack(len(payload) + 1, version) + payload


def decode_body(payload: bytes) -> dict[str, Any]:
    """The msgpack map a frame carries; `MalformedFrameError` if it is anything else."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise MalformedFrameError(f"frame body is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise MalformedFrameError(f"frame body must be a map, got {type(body).__name__}")
    return body


class FrameDecoder:
    """Turns a byte stream into frame payloads; raises on the first framing error.

    After a `FrameTooLargeError` or `UnsupportedVersionError` the stream can no
    longer be trusted: the decoder stays broken and the connection must close.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, limit_name: str = "max_frame_size") -> None:
        """``limit_name``: what a `FrameTooLargeError` calls the limit (both may change between feeds)."""
        if max_frame_size < 1:
            raise ValueError(f"max_frame_size must be at least 1, got {max_frame_size}")
        self.max_frame_size = max_frame_size
        self.limit_name = limit_name
        self._buffer = bytearray()
        self._broken: Exception | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buffer)

    def feed(self, data: bytes, stop: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Add ``data``; return the payloads (body bytes) of every frame now complete.

        Frames that ``data`` holds whole are cut from it directly (one copy each); only a
        frame split across chunks waits in the buffer, which is read once it is complete.
        With ``stop``, the frames end with the first payload it accepts: what follows waits,
        unchecked, for the next call (``feed(b"")``), which may come with another limit.
        """
        if self._broken is not None:
            raise self._broken
        source: bytes | memoryview = data
        if self._buffer:
            self._buffer += data
            if not self._complete(self._buffer):
                return []
            source, self._buffer = memoryview(self._buffer), bytearray()  # the old one is only read now
        frames: list[bytes] = []
        position, size = 0, len(source)
        while size - position >= PREFIX.size:
            length, version = PREFIX.unpack_from(source, position)
            self._check(length, version)
            end = position + 4 + length
            if size < end:
                break
            frames.append(bytes(source[position + PREFIX.size:end]))  # a slice of bytes is bytes already
            position = end
            if stop is not None and stop(frames[-1]):
                self._buffer += source[position:]
                return frames
        if position < size:
            self._buffer += source[position:]
            self._complete(self._buffer)  # a length prefix alone is checked already
        return frames

    def _complete(self, buffer: bytearray) -> bool:
        """Whether ``buffer`` holds its first frame whole (its length checked as soon as known)."""
        if len(buffer) < 4:
            return False
        if len(buffer) < PREFIX.size:
            self._check_length(struct.unpack_from(">I", buffer)[0])
            return False
        length, version = PREFIX.unpack_from(buffer)
        self._check(length, version)
        return len(buffer) >= 4 + length

    def _check(self, length: int, version: int) -> None:
        self._check_length(length)
        if version != VERSION:
            self._fail(UnsupportedVersionError(
                f"protocol version {version} is not supported (this server speaks {VERSION})"))

    def _check_length(self, length: int) -> None:
        if length > self.max_frame_size:
            self._fail(FrameTooLargeError(
                f"frame of {length} bytes exceeds {self.limit_name} {self.max_frame_size}"))
        if length < 1:
            self._fail(BrokenStreamError("frame length 0 leaves no room for the version byte"))

    def _fail(self, error: Exception) -> None:
        self._broken = error
        self._buffer.clear()
        raise error
