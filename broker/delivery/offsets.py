"""The committed offsets of clustering groups, kept by the broker in one JSON file.

A group's committed offset of a queue is its lowest unacknowledged one, so a
restart redelivers only what was not done. The file is written atomically
(temporary file, fsync, rename, fsync of the directory) every
``offset_flush_interval`` seconds when something changed, and on close; a
write that fails (a full disk) is tried again at the next flush.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

OffsetKey = tuple[str, str, int]  # group, topic, queue


class OffsetBook:
    """Committed offsets per (group, topic, queue), loaded at start and flushed on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets: dict[OffsetKey, int] = {}
        self._dirty = False
        self._lock = threading.Lock()
        if path.exists():
            for entry in json.loads(path.read_text()):
                self._offsets[(entry["group"], entry["topic"], entry["queue"])] = entry["offset"]

    def get(self, key: OffsetKey) -> int | None:
        return self._offsets.get(key)

    def put(self, key: OffsetKey, offset: int) -> None:
        if self._offsets.get(key) != offset:
            self._offsets[key] = offset
            self._dirty = True

    def of_group(self, group: str) -> dict[tuple[str, int], int]:
        return {(topic, queue): offset for (g, topic, queue), offset in self._offsets.items() if g == group}

    def groups(self) -> set[str]:
        return {group for group, _, _ in self._offsets}

    def absorb(self, acked: dict[OffsetKey, set[int]], sought: dict[OffsetKey, int]
               ) -> dict[OffsetKey, set[int]]:
        """Take the ack journal's seeks (``sought``), then move each committed offset past the
        offsets ``acked`` says are done in a row; what is done above it, per key."""
        ahead: dict[OffsetKey, set[int]] = {}
        for key, offsets in acked.items():
            committed = sought.get(key, self._offsets.get(key))
            if committed is not None:
                while committed in offsets:
                    committed += 1
                self.put(key, committed)
            ahead[key] = {o for o in offsets if committed is None or o > committed}
        return ahead

    def lowest_needed(self) -> dict[tuple[str, int], int]:
        """Per queue, the lowest offset some group still needs (the retention guard)."""
        needed: dict[tuple[str, int], int] = {}
        for (_, topic, queue), offset in self._offsets.items():
            needed[(topic, queue)] = min(offset, needed.get((topic, queue), offset))
        return needed

    def flush(self) -> None:
        """Write the offsets if they changed since the last flush."""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            entries = [{"group": g, "topic": t, "queue": q, "offset": o}
                       for (g, t, q), o in sorted(self._offsets.items())]
            partial = self.path.with_suffix(".tmp")
            try:
                with open(partial, "w") as out:
                    json.dump(entries, out)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(partial, self.path)
            except OSError:  # a full disk, say: the file keeps the last offsets written
                self._dirty = True  # so the next flush tries again
                partial.unlink(missing_ok=True)
                raise
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
