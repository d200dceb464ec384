"""STOMP frames (1.0, 1.1, 1.2): an incremental parser and a serializer.

A frame is ``COMMAND EOL (header EOL)* EOL body NUL``. The rules that differ
by version, as the specification gives them:

* 1.2 lines may end in CR LF; 1.0 and 1.1 lines end in LF only;
* header escaping: none in 1.0; ``\\n \\c \\\\`` in 1.1; 1.2 adds ``\\r``; CONNECT
  and CONNECTED frames are never escaped; an undefined escape is fatal;
* a repeated header: the first occurrence wins.

Between frames any number of EOLs may arrive (heart-beats). A body that may
contain NUL bytes needs ``content-length``; without it the body ends at the
first NUL. The parser refuses a frame as soon as its size is known to exceed
the maximum: from ``content-length`` before any body byte is buffered, or from
the bytes buffered so far.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from broker.protocol.errors import BrokenStreamError, FrameTooLargeError, ProtocolError

VERSIONS = ("1.0", "1.1", "1.2")
HEARTBEAT = b"\n"
UNESCAPED_COMMANDS = frozenset({"CONNECT", "STOMP", "CONNECTED"})
_ESCAPES = {
    "1.0": {},
    "1.1": {"\\": "\\\\", "\n": "\\n", ":": "\\c"},
    "1.2": {"\\": "\\\\", "\n": "\\n", ":": "\\c", "\r": "\\r"},
}
_UNESCAPES = {v: {code: char for char, code in table.items()} for v, table in _ESCAPES.items()}
_HEADER_END = {"1.0": re.compile(rb"\n\n"), "1.1": re.compile(rb"\n\n"),
               "1.2": re.compile(rb"\n\r?\n")}
_ESCAPE_SEQUENCE = re.compile(r"\\(.?)", re.DOTALL)
#: a number on the wire: ASCII digits only (not ``²`` or ``٣``, which `str.isdigit` accepts),
#: at most 18 of them, so `int` never meets a 4,301-digit string
_NUMBER = re.compile(r"[0-9]{1,18}", re.ASCII)


def parse_number(header: str, raw: str, error: type[ProtocolError], what: str = "a whole number") -> int:
    """The whole number ``raw`` of ``header``; anything else raises ``error`` naming the header."""
    if not _NUMBER.fullmatch(raw):
        raise error(f"header {header}: {raw[:40]!r} is not {what} (at most 18 ASCII digits)")
    return int(raw)


@dataclass(frozen=True)
class StompFrame:
    """One frame; ``headers`` keep the first occurrence of each name, in order."""

    command: str
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


def encode(frame: StompFrame, version: str = "1.2") -> bytes:
    """The frame's bytes; a non-empty body always gets ``content-length``.

    A header the peer's ``version`` cannot carry (`carried`) is left out: written as it is,
    it would end the frame or its headers early, and the rest would read as frames of its own.
    """
    escape = frame.command not in UNESCAPED_COMMANDS
    headers = {k: v for k, v in frame.headers.items()
               if k != "content-length" and carried(k, v, version if escape else "1.0")}
    if frame.body:
        headers["content-length"] = str(len(frame.body))
    lines = [frame.command]
    for name, value in headers.items():
        if escape:
            name, value = _escape(name, version), _escape(value, version)
        lines.append(f"{name}:{value}")
    return ("\n".join(lines) + "\n\n").encode() + frame.body + b"\0"


def carried(name: str, value: str, version: str) -> bool:
    """Whether a STOMP ``version`` frame can carry the header ``name: value`` unchanged.

    No version escapes NUL, and clients cut a frame at the first one (stomp.py does);
    1.0 (and CONNECTED in any version) escapes nothing: no line feed, and no ':' in a name.
    """
    if "\0" in name or "\0" in value:
        return False
    return bool(_ESCAPES[version]) or not ("\n" in name or "\n" in value or ":" in name)


def _escape(text: str, version: str) -> str:
    table = _ESCAPES[version]
    return "".join(table.get(char, char) for char in text) if table else text


def _unescape(text: str, version: str) -> str:
    table = _UNESCAPES[version]
    if not table:
        return text

    def replace(match: re.Match[str]) -> str:
        sequence = match.group(0)
        if sequence not in table:
            raise BrokenStreamError(f"undefined escape sequence {sequence!r} in a STOMP {version} header")
        return table[sequence]

    return _ESCAPE_SEQUENCE.sub(replace, text)


class StompDecoder:
    """Turns a byte stream into `StompFrame`s; ``version`` is set once CONNECT has negotiated it."""

    def __init__(self, max_frame_size: int, version: str = "1.2", limit_name: str = "max_frame_size") -> None:
        """``limit_name``: what a `FrameTooLargeError` calls the limit (both may change between frames)."""
        self.max_frame_size = max_frame_size
        self.limit_name = limit_name
        self.version = version
        self._buffer = bytearray()
        self._scanned = 0
        self._pending: tuple[str, dict[str, str], int, int | None] | None = None

    def feed(self, data: bytes) -> list[StompFrame]:
        """Add ``data``; return every frame now complete (heart-beats are consumed silently)."""
        return list(self.frames(data))

    def frames(self, data: bytes) -> Iterator[StompFrame]:
        """Add ``data``; yield the complete frames one by one, so that each is handled before
        a broken one after it raises (a CONNECT followed by garbage is still answered)."""
        self._buffer += data
        while (frame := self._next()) is not None:
            yield frame

    def _next(self) -> StompFrame | None:
        if self._pending is None:
            self._skip_heartbeats()
            if not self._read_headers():
                return None
        assert self._pending is not None
        command, headers, body_start, length = self._pending
        if length is None:
            end = self._buffer.find(b"\0", max(body_start, self._scanned))
            if end < 0:
                self._scanned = len(self._buffer)  # a body fed in pieces is searched once, not again per piece
                self._check_size(len(self._buffer))
                return None
        else:
            end = body_start + length
            if len(self._buffer) <= end:
                return None
            if self._buffer[end] != 0:
                raise BrokenStreamError(
                    f"{command} frame: no NUL after the {length} bytes of content-length")
        frame = StompFrame(command, headers, bytes(self._buffer[body_start:end]))
        del self._buffer[:end + 1]
        self._pending, self._scanned = None, 0
        return frame

    def _skip_heartbeats(self) -> None:
        start = 0
        while start < len(self._buffer) and self._buffer[start] in b"\r\n":
            start += 1
        if start:
            del self._buffer[:start]

    def _read_headers(self) -> bool:
        end = _HEADER_END[self.version].search(self._buffer, max(0, self._scanned - 2))
        if end is None:
            self._check_start()
            self._scanned = len(self._buffer)
            self._check_size(len(self._buffer))
            return False
        command, headers = self._parse_head(bytes(self._buffer[:end.start()]))
        raw_length = headers.get("content-length")
        length = None if raw_length is None else parse_number("content-length", raw_length,
                                                              BrokenStreamError, "a byte count")
        if length is not None:
            self._check_size(end.end() + length + 1)
        self._pending = (command, headers, end.end(), length)
        return True

    def _parse_head(self, head: bytes) -> tuple[str, dict[str, str]]:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BrokenStreamError(f"frame headers are not UTF-8: {exc}") from exc
        lines = text.split("\n")
        if self.version == "1.2":
            lines = [line.removesuffix("\r") for line in lines]
        command = lines[0]
        if not command or not command.isalpha():
            raise BrokenStreamError(f"invalid STOMP command {command[:40]!r}")
        headers: dict[str, str] = {}
        for name, value in self._header_pairs(command, lines[1:]):
            headers.setdefault(name, value)
        return command, headers

    def _header_pairs(self, command: str, lines: Iterable[str]) -> Iterable[tuple[str, str]]:
        escaped = command not in UNESCAPED_COMMANDS
        for line in lines:
            name, colon, value = line.partition(":")
            if not colon:
                raise BrokenStreamError(f"{command} frame: header line {line[:40]!r} has no ':'")
            if escaped:
                name, value = _unescape(name, self.version), _unescape(value, self.version)
            yield name, value

    def _check_start(self) -> None:
        """Refuse at its first byte a stream no command can begin (a native-protocol client on the
        STOMP port: its length prefix starts with a zero byte), rather than at the handshake timeout."""
        if self._buffer and not self._buffer[:1].isalpha():
            raise BrokenStreamError(f"not a STOMP frame: it begins with {bytes(self._buffer[:16])!r} "
                                    "(a STOMP command begins with a letter)")

    def _check_size(self, size: int) -> None:
        if size > self.max_frame_size:
            self._buffer.clear()
            raise FrameTooLargeError(
                f"STOMP frame of at least {size} bytes exceeds {self.limit_name} {self.max_frame_size}")
