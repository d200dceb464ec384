"""`RecentRecords`: the records just appended, handed to readers without reading the log back.

A consumer that keeps up reads what producers appended a moment ago. The
writer leaves each batch it wrote here, as the columns it was given (the
bodies, ids and keys themselves: nothing is copied), and `read_span` takes a
run of a queue from here when every record of it is still held, instead of
reading the log and decoding it again. Kafka and RocketMQ serve the tail of
their logs from memory (the page cache) the same way.

Batches are dropped oldest first once what is held passes ``limit`` bytes
(counted as the records' framed size plus `PER_RECORD` bytes of Python objects each);
a reader further behind reads the log, where every record is CRC-checked.
What is held here never went through the disk, so it needs no check: it is
what the producer sent. A batch held is never changed, and readers need no
lock: the table (first log offsets, batches, how many are dropped) is one
tuple, its lists only ever grow (a batch before its first offset), and once a
quarter of them are dropped the lists are copied without those and the
table replaced whole: an append costs the same however many batches are held.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

from broker.store.columns import RunColumns

Picked = slice | list[int]  # where a run's records lie in a batch


class Same(NamedTuple):
    """A column whose every value is ``value`` (a batch without keys, say): held once."""

    value: Any


Column = Sequence[Any] | Same


class HeldBatch(NamedTuple):
    """One append's records in log order: their log offsets, framed sizes and fields."""

    offsets: Sequence[int]
    sizes: Sequence[int]
    fields: tuple[Column, ...]  # in the order of `RunColumns`
    weight: int  # bytes of memory it holds, as `weight` counts them

    @property
    def end(self) -> int:
        return self.offsets[-1] + self.sizes[-1]

    def pick(self, wanted: Sequence[int], sizes: Sequence[int]) -> Picked | None:
        """Where the records at log offsets ``wanted`` (of the consume-queue ``sizes``) lie in the
        batch; None if one of them is not a record of it. A queue's records in a batch are
        mostly evenly spaced (one queue, or round robin over several): one slice then."""
        offsets = self.offsets
        first = bisect_left(offsets, wanted[0])
        if first == len(offsets):
            return None
        step = bisect_left(offsets, wanted[1], first + 1) - first if len(wanted) > 1 else 1
        spaced = slice(first, first + step * (len(wanted) - 1) + 1, step)
        picked: Picked = spaced
        if offsets[spaced] != wanted:
            index = dict(zip(offsets, range(len(offsets))))
            positions = list(map(index.get, wanted))
            if None in positions:
                return None
            picked = positions  # type: ignore[assignment]
        return picked if _taken(self.sizes, picked) == sizes else None

    def columns(self, picked: Picked, count: int) -> list[Sequence[Any]]:
        """The fields of the records ``picked``, one column each."""
        return [[column.value] * count if isinstance(column, Same) else _taken(column, picked)
                for column in self.fields]


def _taken(column: Sequence[Any], picked: Picked) -> Sequence[Any]:
    if isinstance(picked, slice):
        return list(column[picked])
    return list(map(column.__getitem__, picked))


PER_RECORD = 160  # bytes of Python objects a record held costs beyond its framed size (id, ints, slots)


def weight(sizes: Sequence[int]) -> int:
    """The memory records of these framed ``sizes`` are counted as holding."""
    return sum(sizes) + PER_RECORD * len(sizes)


def column(values: Sequence[Any]) -> Column:
    """``values`` as a batch holds them: `Same` when they are all one value."""
    first = values[0]
    return Same(first) if values.count(first) == len(values) else values


class RecentRecords:
    """The batches appended last, up to ``limit`` bytes (0: none are held)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._table: tuple[list[int], list[HeldBatch], int] = ([], [], 0)  # first offsets, batches, dropped
        self._held = 0

    def add(self, offsets: Sequence[int], sizes: Sequence[int], message_ids: Sequence[str],
            keys: Sequence[str], tags: Sequence[str], headers: Sequence[Mapping[str, str]],
            bodies: Sequence[bytes], store_time: float, attempts: Sequence[int]) -> None:
        """Hold a batch just written (the writer lock held: one writer at a time)."""
        held = weight(sizes)
        if not offsets or held > self.limit:
            self.clear()
            return
        batch = HeldBatch(offsets, sizes, (message_ids, column(keys), column(tags), column(headers),
                                           bodies, Same(store_time), column(attempts)), held)
        starts, batches, dropped = self._table
        batches.append(batch)
        starts.append(offsets[0])
        self._held += held
        while self._held > self.limit:
            self._held -= batches[dropped].weight
            dropped += 1
        if dropped * 4 >= len(batches):  # let the dropped batches go
            self._table = (starts[dropped:], batches[dropped:], 0)
        else:
            self._table = (starts, batches, dropped)

    def clear(self) -> None:
        self._table, self._held = ([], [], 0), 0

    def take(self, log_offsets: Sequence[int], sizes: Sequence[int]) -> RunColumns | None:
        """The fields of the records at ``log_offsets`` (in log order, of the consume-queue
        ``sizes``), if every one of them is held; None if one is not."""
        starts, batches, dropped = self._table
        number = bisect_right(starts, log_offsets[0]) - 1 if log_offsets else -1
        if number < dropped:
            return None
        pieces: list[list[Sequence[Any]]] = []
        done, count = 0, len(log_offsets)
        while done < count:
            if number >= len(batches):
                return None
            batch = batches[number]
            upto = bisect_left(log_offsets, batch.end, done)
            if upto == done:
                return None
            picked = batch.pick(log_offsets[done:upto], sizes[done:upto])
            if picked is None:
                return None
            pieces.append(batch.columns(picked, upto - done))
            done, number = upto, number + 1
        if len(pieces) == 1:
            return RunColumns(*pieces[0])
        return RunColumns(*(list(chain.from_iterable(parts)) for parts in zip(*pieces)))
