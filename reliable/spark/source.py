"""The broker as a Spark streaming source (PySpark's Python Data Source API).

    spark.dataSource.register(ReliableSource)
    stream = (spark.readStream.format("reliable")
              .option("url", "reliable://broker:7600")      # or embedded://DIR
              .option("topic", "orders").option("group", "spark-orders")
              .option("maxRowsPerBatch", 10000).load())

The queues' offsets are the stream's offsets (``{"q0": 12, "q1": 7, ...}``);
a range always yields the same rows, because the broker is read by position
(`BrokerApi.read_columns`), outside any group. Each queue with rows in the
range is one partition (``maxPartitions``: at most that many, a partition
then reading several queues' ranges one after another), read on the
executors, which hand Spark Arrow record batches made from the read's
columns (`reliable.spark.arrow`): no Python object per row between the
broker and the JVM. ``maxRowsPerBatch`` is admission
control (shared fairly between the queues); ``trigger(availableNow=True)``
reads what is there and stops. When Spark commits a range (it does so when
it plans the next batch), the group's broker offsets move to its end
(`BrokerApi.commit_group`): lag and retention follow the query. A new query
starts at the group's committed offsets (or the first kept message); a
restarted one at its checkpoint, so a batch written but not committed by
Spark is read again, with the same rows (the `foreach_batch` fence skips it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from backends.errors import ConfigurationError
from broker.local_client import connect_local

if TYPE_CHECKING:
    import pyarrow as pa

# `reliable.spark.arrow` (pyarrow, its compute functions, numpy) is imported where it is used:
# Spark's fresh process for a query's offsets, which runs the driver's half of the reader,
# never builds a batch.

FIRST_READ, MAX_READ = 1000, 10_000  # messages per broker read (one Arrow batch for Spark)
READ_BYTES = 2 * 1024 * 1024  # a read's bodies, about: well below the 8 MiB frame of the protocol


def open_api(url: str) -> Any:
    """The `BrokerApi` at ``url``: ``reliable://host:port`` or ``embedded://DIR``.

    Spark runs this in a fresh Python process at every query's start (the offsets), and in its
    workers: an embedded directory with an owner is read through the owner's socket alone
    (`broker.local_client`), without importing the engine and the store."""
    scheme, _, rest = url.partition("://")
    if scheme == "reliable":
        from broker.client import Client

        return Client(url)
    if scheme == "embedded":
        directory = rest.partition("?")[0]
        served = connect_local(directory)  # its owner's socket: the engine is not imported here
        if served is not None:
            return served
        # nobody serves it yet: own it, or wait for an owner that is starting
        from broker.embedded import open_embedded

        return open_embedded(directory)
    raise ConfigurationError(f"reliable source: url {url!r} is not reliable://host:port or embedded://DIR")


@dataclass
class QueueRange(InputPartition):  # type: ignore[misc]
    """One queue's rows of a micro-batch: offsets ``start`` (included) to ``end`` (excluded)."""

    url: str
    topic: str
    queue: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass
class QueueRanges(InputPartition):  # type: ignore[misc]
    """Several queues' rows of a micro-batch, read by one Spark task one range after another."""

    ranges: tuple[QueueRange, ...]


class ReliableSource(DataSource):  # type: ignore[misc]
    """``format("reliable")``: options ``url`` (or ``settings``: a reliable.toml whose
    ``[transport] url`` names the broker), ``topic``, ``group``, ``maxRowsPerBatch``,
    ``maxPartitions``."""

    @classmethod
    def name(cls) -> str:
        return "reliable"

    def schema(self) -> str:
        from reliable.spark.arrow import SCHEMA

        return SCHEMA

    def streamReader(self, schema: Any) -> ReliableStreamReader:
        return ReliableStreamReader(dict(self.options))


class ReliableStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    """Offsets, admission control and commits on the driver; `read` on the executors."""

    def __init__(self, options: dict[str, str]) -> None:
        options = dict(options)
        if not options.get("url") and options.get("settings"):  # the same reliable.toml as the app
            from reliable.settings import Settings

            options["url"] = Settings.load(options["settings"]).transport.url
        missing = [name for name in ("url", "topic") if not options.get(name)]
        if missing:
            raise ConfigurationError(f"reliable source: option(s) {', '.join(missing)} required")
        self.url, self.topic = options["url"], options["topic"]
        self.group = options.get("group") or None
        self.max_rows = _at_least_one(options, "maxRowsPerBatch")
        self.max_partitions = _at_least_one(options, "maxPartitions")
        self._api: Any = None
        self._target: dict[str, int] | None = None  # availableNow: the end at the query's start

    @property
    def api(self) -> Any:
        """The driver's broker handle (an embedded broker's owner, if nobody owns it yet)."""
        if self._api is None:
            self._api = open_api(self.url)
        return self._api

    def __getstate__(self) -> dict[str, Any]:  # sent to the executors without the driver's handle
        return {**self.__dict__, "_api": None}

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        bounds = self.api.queue_offsets(self.topic)
        saved = self.api.group_offsets(self.group, self.topic) if self.group else [None] * len(bounds)
        start = {}
        for q, (first, _) in enumerate(bounds):
            committed = saved[q]
            start[f"q{q}"] = first if committed is None else int(committed)
        return start

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - Spark's name
        return ReadMaxRows(self.max_rows) if self.max_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        self._target = self._ends()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:  # noqa: N802
        ends = self._target if self._target is not None else self._ends()
        begin = {name: min(start.get(name, 0), ends[name]) for name in ends}
        limit = limit if isinstance(limit, ReadMaxRows) else self.getDefaultReadLimit()
        if not isinstance(limit, ReadMaxRows):
            return ends
        return share(begin, ends, limit.max_rows)

    def _ends(self) -> dict[str, int]:
        return {f"q{q}": end for q, (_, end) in enumerate(self.api.queue_offsets(self.topic))}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[QueueRange | QueueRanges]:
        ranges = [QueueRange(self.url, self.topic, int(name[1:]), start.get(name, 0), stop)
                  for name, stop in sorted(end.items()) if stop > start.get(name, 0)]
        if self.max_partitions is None or len(ranges) <= self.max_partitions:
            return list(ranges)
        return [QueueRanges(tuple(group)) for group in balanced(ranges, self.max_partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The partition's rows as Arrow batches, one per broker read (see reliable.spark.arrow)."""
        assert isinstance(partition, QueueRange | QueueRanges)
        ranges = partition.ranges if isinstance(partition, QueueRanges) else (partition,)
        api = open_api(ranges[0].url)  # on an executor: a client of the broker
        try:
            for queue_range in ranges:
                yield from read_range(api, queue_range)
        finally:
            api.close()

    def commit(self, end: dict[str, int]) -> None:
        if self.group:
            self.api.commit_group(self.group, self.topic, [end[f"q{q}"] for q in range(len(end))])

    def stop(self) -> None:
        if self._api is not None:
            self._api.close()


def read_range(api: Any, queue_range: QueueRange) -> Iterator[pa.RecordBatch]:
    """One queue's range as Arrow batches. Each read asks for as many messages as make about
    `READ_BYTES` of bodies at the size of the last read's: few round trips to the broker for
    small messages, small replies for large ones."""
    from reliable.spark.arrow import record_batch

    offset, size, end = queue_range.start, FIRST_READ, queue_range.end
    while offset < end:
        read = api.read_columns(queue_range.topic, queue_range.queue, offset, min(size, end - offset))
        if not read.count:
            return
        offsets = read.column("offset")
        if offsets[-1] >= end:  # retention moved the start: never past the range
            read = read.split([bisect_left(offsets, end)])[0]
        if read.count:
            batch = record_batch(read.count, dict(read.same), dict(read.columns))
            size = next_read(batch.column("body").nbytes, batch.num_rows)
            yield batch
        offset = offsets[-1] + 1


def balanced(ranges: list[QueueRange], parts: int) -> list[list[QueueRange]]:
    """``ranges`` in at most ``parts`` groups of about as many rows each (the largest range
    first into the group with the fewest rows), each group in queue order."""
    groups: list[list[QueueRange]] = [[] for _ in range(parts)]
    for queue_range in sorted(ranges, key=lambda r: -r.rows):
        min(groups, key=lambda group: sum(r.rows for r in group)).append(queue_range)
    return [sorted(group, key=lambda r: r.queue) for group in groups if group]


def _at_least_one(options: dict[str, str], name: str) -> int | None:
    """The option ``name`` (Spark may hand it over lower-cased) as an integer >= 1, or None."""
    value = options.get(name) or options.get(name.lower())
    if value is not None and (not str(value).isdigit() or int(value) < 1):
        raise ConfigurationError(f"reliable source: {name}={value!r}: an integer >= 1 is required")
    return int(value) if value is not None else None


def next_read(body_bytes: int, rows: int) -> int:
    """How many messages the next read asks for, after one of ``rows`` with ``body_bytes``."""
    return max(1, min(MAX_READ, READ_BYTES * rows // max(1, body_bytes)))


def share(start: dict[str, int], end: dict[str, int], max_rows: int) -> dict[str, int]:
    """The end offsets of at most ``max_rows`` rows, shared fairly between the queues."""
    left = {name: end[name] - start[name] for name in end}
    taken = dict.fromkeys(end, 0)
    budget = max_rows
    while budget > 0 and any(left[n] > taken[n] for n in end):
        open_queues = [n for n in end if left[n] > taken[n]]
        each = max(1, budget // len(open_queues))
        for name in open_queues:
            more = min(each, left[name] - taken[name], budget)
            taken[name] += more
            budget -= more
    return {name: start[name] + taken[name] for name in end}

