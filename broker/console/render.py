"""A message body as a person can read it: JSON pretty-printed, else text, else a hex dump.

The result is plain text; templates escape it, so a body holding ``<script>``
is shown, never run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PREVIEW = 120


@dataclass(frozen=True)
class Body:
    kind: str  # "json", "text" or "hex"
    text: str


def show(body: bytes) -> Body:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return Body("hex", hexdump(body))
    try:
        return Body("json", json.dumps(json.loads(text), indent=2, ensure_ascii=False))
    except ValueError:
        pass
    if all(c.isprintable() or c in "\n\r\t" for c in text):
        return Body("text", text)
    return Body("hex", hexdump(body))


def preview(body: bytes) -> str:
    """One line of the body for a table cell."""
    shown = show(body)
    line = " ".join(shown.text.split()) if shown.kind != "hex" else body[:PREVIEW // 3].hex(" ")
    return line if len(line) <= PREVIEW else line[: PREVIEW - 1] + "…"


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
