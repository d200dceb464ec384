"""The messages a queue cursor keeps by offset alone: *spilled* (ready again, to be read from the
store) and *parked* (not due yet), each as columns of machine numbers.

Kept as a tuple per message, ``(due, offset, deliveries)`` in a heap or ``(offset, deliveries)``
in a sorted list, each cost about 130 bytes (the tuple, its float and ints, the list's slot):
ten million tiny messages scheduled for tomorrow held 1.3 GB in every group reading their topic.
Here a parked message is 20 bytes (an 8-byte due time, an 8-byte offset, a 4-byte count in
`array`\\ s, kept as a binary heap by due time) and a spilled one 12.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator


class Spilled:
    """Offsets with their delivery counts so far, sorted by offset."""

    def __init__(self) -> None:
        self.offsets, self.counts = array("q"), array("i")

    def __len__(self) -> int:
        return len(self.offsets)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.offsets, self.counts)

    def add(self, offset: int, delivered: int) -> None:
        at = bisect_left(self.offsets, offset)
        self.offsets.insert(at, offset)
        self.counts.insert(at, delivered)

    def extend(self, entries: Iterable[tuple[int, int]]) -> None:
        merged = sorted([*self, *entries])
        self.offsets, self.counts = array("q", (o for o, _ in merged)), array("l", (c for _, c in merged))

    def take(self, count: int) -> list[tuple[int, int]]:
        """The lowest ``count`` entries, taken out."""
        taken = list(zip(self.offsets[:count], self.counts[:count]))
        del self.offsets[:count], self.counts[:count]
        return taken

    def drop_below(self, offset: int) -> None:
        at = bisect_left(self.offsets, offset)
        del self.offsets[:at], self.counts[:at]

    def clear(self) -> None:
        del self.offsets[:], self.counts[:]


class Parked:
    """Offsets with their delivery counts, each due at a (monotonic) time: a binary heap by due
    time over three arrays, as `heapq` keeps a list (the earliest at index 0)."""

    def __init__(self) -> None:
        self.dues, self.offsets, self.counts = array("d"), array("q"), array("i")

    def __len__(self) -> int:
        return len(self.dues)

    def __iter__(self) -> Iterator[tuple[float, int, int]]:
        """The entries as ``(due, offset, deliveries)``, in heap order."""
        return zip(self.dues, self.offsets, self.counts)

    def next_due(self) -> float | None:
        return self.dues[0] if self.dues else None

    def push(self, due: float, offset: int, delivered: int) -> None:
        self.dues.append(due)
        self.offsets.append(offset)
        self.counts.append(delivered)
        self._up(len(self.dues) - 1)

    def pop_due(self, now: float) -> Iterator[tuple[int, int]]:
        """Take out, earliest first, every entry due by ``now``: its offset and count."""
        while self.dues and self.dues[0] <= now:
            yield self.offsets[0], self.counts[0]
            self._move(len(self.dues) - 1, 0)
            for column in (self.dues, self.offsets, self.counts):
                column.pop()
            if self.dues:
                self._down(0)

    def drop_below(self, offset: int) -> None:
        kept = [entry for entry in self if entry[1] >= offset]
        self.clear()
        for entry in sorted(kept):  # a sorted array is a heap
            self.dues.append(entry[0])
            self.offsets.append(entry[1])
            self.counts.append(entry[2])

    def clear(self) -> None:
        del self.dues[:], self.offsets[:], self.counts[:]

    def _move(self, source: int, target: int) -> None:
        self.dues[target], self.offsets[target], self.counts[target] = (
            self.dues[source], self.offsets[source], self.counts[source])

    def _up(self, at: int) -> None:
        """The entry at ``at`` moves up while earlier than its parent."""
        entry = self.dues[at], self.offsets[at], self.counts[at]
        while at > 0 and entry[0] < self.dues[parent := (at - 1) // 2]:
            self._move(parent, at)
            at = parent
        self.dues[at], self.offsets[at], self.counts[at] = entry

    def _down(self, at: int) -> None:
        """The entry at ``at`` moves down while a child is earlier."""
        entry, end = (self.dues[at], self.offsets[at], self.counts[at]), len(self.dues)
        while (child := 2 * at + 1) < end:
            if child + 1 < end and self.dues[child + 1] < self.dues[child]:
                child += 1
            if self.dues[child] >= entry[0]:
                break
            self._move(child, at)
            at = child
        self.dues[at], self.offsets[at], self.counts[at] = entry
