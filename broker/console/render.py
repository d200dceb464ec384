"""A message body as a person can read it: JSON pretty-printed, else text, else a hex dump.

The result is plain text; templates escape it, so a body holding ``<script>``
is shown, never run. A page shows at most the first `SHOWN` bytes of a body
and says so: a 100 MiB body made a hex dump of about 500 MB in memory and a
page as large (and a listing's one-line preview decoded it whole for each row).
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass

PREVIEW = 120
PREVIEW_READS = PREVIEW * 4
"""Bytes of a body a one-line preview reads (a listing asks its source for no more)."""
SHOWN = 64 * 1024
"""Bytes of a body a page shows (a hex dump of them is about 320 KiB of text)."""


@dataclass(frozen=True)
class Body:
    kind: str  # "json", "text" or "hex"
    text: str
    size: int = 0  # the body's bytes
    shown: int = 0  # how many of them ``text`` shows

    @property
    def cut(self) -> bool:
        return self.shown < self.size


def show(body: bytes, limit: int = SHOWN, size: int | None = None) -> Body:
    """The first ``limit`` bytes of ``body`` as a person reads them (JSON only when whole);
    ``size``: the whole body's bytes when ``body`` is only its first bytes."""
    head, size = bytes(body[:limit]), len(body) if size is None else size
    cut = size > len(head)
    try:  # a cut head may end inside a character: the incremental decoder leaves it out
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=not cut)
    except UnicodeDecodeError:
        return Body("hex", hexdump(head), size, len(head))
    if not cut:
        try:
            return Body("json", json.dumps(json.loads(text), indent=2, ensure_ascii=False), size, size)
        except ValueError:
            pass
    if all(c.isprintable() or c in "\n\r\t" for c in text):
        return Body("text", text, size, len(text.encode()))
    return Body("hex", hexdump(head), size, len(head))


def preview(body: bytes, size: int | None = None) -> str:
    """One line of the body for a table cell (from its first `PREVIEW_READS` bytes only)."""
    shown = show(body, PREVIEW_READS, size)
    line = " ".join(shown.text.split()) if shown.kind != "hex" else body[:PREVIEW // 3].hex(" ")
    return line if len(line) <= PREVIEW and not shown.cut else line[: PREVIEW - 1] + "…"


def hexdump(data: bytes, width: int = 16) -> str:
    rows = []
    for at in range(0, len(data), width):
        chunk = data[at:at + width]
        printable = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        rows.append(f"{at:08x}  {chunk.hex(' '):<{width * 3}} {printable}")
    return "\n".join(rows)


def size(count: int) -> str:
    """A byte count as a person reads it, the exact figure beside: ``1.5 KiB (1,536 B)``."""
    if count < 1024:
        return f"{count} B"
    value, power = float(count) / 1024, 0
    while value >= 1024 and power < 3:
        value, power = value / 1024, power + 1
    return f"{value:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power]} ({count:,} B)"
