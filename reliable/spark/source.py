"""The broker as a Spark streaming source (PySpark's Python Data Source API).

    spark.dataSource.register(ReliableSource)
    stream = (spark.readStream.format("reliable")
              .option("url", "reliable://broker:7600")      # or embedded://DIR
              .option("topic", "orders").option("group", "spark-orders")
              .option("maxRowsPerBatch", 10000).load())

The queues' offsets are the stream's offsets (``{"q0": 12, "q1": 7, ...}``);
a range always yields the same rows, because the broker is read by position
(`BrokerApi.read`), outside any group. Each queue with rows in the range is
one partition, read on the executors. ``maxRowsPerBatch`` is admission
control (shared fairly between the queues); ``trigger(availableNow=True)``
reads what is there and stops. When Spark commits a range (it does so when
it plans the next batch), the group's broker offsets move to its end
(`BrokerApi.commit_group`): lag and retention follow the query. A new query
starts at the group's committed offsets (or the first kept message); a
restarted one at its checkpoint, so a batch written but not committed by
Spark is read again, with the same rows (the `foreach_batch` fence skips it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from backends.errors import ConfigurationError
from backends.types import CONTENT_TYPE, JSON

SCHEMA = ("topic string, queue int, offset long, message_id string, key string, tag string, "
          "headers map<string,string>, body binary, json string, published_at timestamp, "
          "delivery_count int")
READ_CHUNK = 1000


def open_api(url: str) -> Any:
    """The `BrokerApi` at ``url``: ``reliable://host:port`` or ``embedded://DIR``."""
    scheme, _, rest = url.partition("://")
    if scheme == "reliable":
        from broker.client import Client

        return Client(url)
    if scheme == "embedded":
        from broker.embedded import open_embedded

        return open_embedded(rest.partition("?")[0])
    raise ConfigurationError(f"reliable source: url {url!r} is not reliable://host:port or embedded://DIR")


@dataclass
class QueueRange(InputPartition):  # type: ignore[misc]
    """One queue's rows of a micro-batch: offsets ``start`` (included) to ``end`` (excluded)."""

    url: str
    topic: str
    queue: int
    start: int
    end: int


class ReliableSource(DataSource):  # type: ignore[misc]
    """``format("reliable")``: options ``url``, ``topic``, ``group``, ``maxRowsPerBatch``."""

    @classmethod
    def name(cls) -> str:
        return "reliable"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> ReliableStreamReader:
        return ReliableStreamReader(dict(self.options))


class ReliableStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    """Offsets, admission control and commits on the driver; `read` on the executors."""

    def __init__(self, options: dict[str, str]) -> None:
        missing = [name for name in ("url", "topic") if not options.get(name)]
        if missing:
            raise ConfigurationError(f"reliable source: option(s) {', '.join(missing)} required")
        self.url, self.topic = options["url"], options["topic"]
        self.group = options.get("group") or None
        limit = options.get("maxRowsPerBatch") or options.get("maxrowsperbatch")
        if limit is not None and (not str(limit).isdigit() or int(limit) < 1):
            raise ConfigurationError(f"reliable source: maxRowsPerBatch={limit!r}: an integer >= 1 is required")
        self.max_rows = int(limit) if limit is not None else None
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

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[QueueRange]:
        return [QueueRange(self.url, self.topic, int(name[1:]), start.get(name, 0), stop)
                for name, stop in sorted(end.items()) if stop > start.get(name, 0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, QueueRange)
        api = open_api(partition.url)  # on an executor: a client of the broker
        try:
            offset = partition.start
            while offset < partition.end:
                deliveries = api.read(partition.topic, partition.queue, offset,
                                      min(READ_CHUNK, partition.end - offset))
                if not deliveries:
                    return
                for d in deliveries:
                    if d.offset >= partition.end:
                        return
                    yield row(d)
                offset = deliveries[-1].offset + 1
        finally:
            api.close()

    def commit(self, end: dict[str, int]) -> None:
        if self.group:
            self.api.commit_group(self.group, self.topic, [end[f"q{q}"] for q in range(len(end))])

    def stop(self) -> None:
        if self._api is not None:
            self._api.close()


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


def row(d: Any) -> tuple[Any, ...]:
    """A delivery as a row of `SCHEMA` (``json``: the body as text when it says it is JSON)."""
    decoded = None
    if d.headers.get(CONTENT_TYPE, "").startswith(JSON):
        try:
            decoded = json.dumps(json.loads(d.body))
        except ValueError:
            decoded = None
    return (d.topic, d.queue, d.offset, d.message_id, d.key or None, d.tag or None, dict(d.headers),
            bytes(d.body), decoded, datetime.fromtimestamp(d.published_at, tz=UTC), d.delivery_count)
