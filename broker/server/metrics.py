"""Prometheus metrics of the server, in a registry of its own, served over plain HTTP.

Names follow DESIGN's vocabulary: connections, frames, protocol errors,
messages published / delivered / acked per topic, auth failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from broker.delivery.values import Delivery, DeliveryColumns

_topic, _body, _delivery_count = attrgetter("topic"), attrgetter("body"), attrgetter("delivery_count")
_FIRST_DELIVERY = 1


def refusals(registry: CollectorRegistry) -> Counter:
    """``broker_connections_refused_total``: connections a listener closed unread, by reason."""
    return Counter("broker_connections_refused", "Connections refused unread: max_connections or the "
                   "address's max_connections_per_address reached (console_max_connections and "
                   "console_max_connections_per_address for listener=\"console\"; the fixed 32 "
                   "and 4 per address for listener=\"metrics\")", ["listener", "reason"],
                   registry=registry)


class ListenerMetrics:
    """The refusals of a listener served beside no broker server (`reliable console`'s), in a
    registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.refused = refusals(self.registry)


class ServerMetrics:
    """The server's counters and gauges; ``listener`` is ``native`` or ``stomp``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.connections = Counter("broker_connections", "Connections accepted", ["listener"], registry=r)
        self.refused = refusals(r)
        self.open = Gauge("broker_connections_open", "Connections open now", ["listener"], registry=r)
        self.frames = Counter("broker_frames", "Frames received", ["listener", "command"], registry=r)
        self.errors = Counter("broker_protocol_errors", "Errors reported to clients",
                              ["listener", "code"], registry=r)
        self.auth_failures = Counter("broker_auth_failures", "Refused credentials", ["listener"],
                                     registry=r)
        self.auth_refused = Counter("broker_auth_refused", "Authentications refused unchecked: their "
                                    "client address was locked out", ["listener"], registry=r)
        self.auth_lockouts = Counter("broker_auth_lockouts", "Client addresses locked out for failed "
                                     "authentications", ["listener"], registry=r)
        self.auth_checks = Gauge("broker_auth_checks", "Password checks running or waiting for a turn",
                                 registry=r)
        self.published = Counter("broker_messages_published", "Messages published", ["topic"],
                                 registry=r)
        self.duplicates = Counter("broker_messages_duplicate", "Resent messages dropped",
                                  ["topic"], registry=r)
        self.delivered = Counter("broker_messages_delivered", "Messages delivered", ["topic"],
                                 registry=r)
        self.timeouts = Counter("broker_connections_timed_out", "Connections closed for idleness "
                                "or a slow reader", ["listener", "reason"], registry=r)
        self.bytes_in = Counter("broker_bytes_published", "Body bytes published", ["topic"], registry=r)
        self.bytes_out = Counter("broker_bytes_delivered", "Body bytes delivered", ["topic"], registry=r)
        self.redelivered = Counter("broker_messages_redelivered", "Deliveries after the first",
                                   ["topic"], registry=r)
        self.dead_lettered = Counter("broker_messages_dead_lettered", "Messages moved to %DLQ%",
                                     ["group"], registry=r)
        self.lag = Gauge("broker_group_lag", "Messages a group has not finished, per queue",
                         ["group", "topic", "queue"], registry=r)
        self.publish_seconds = Histogram(
            "broker_publish_seconds", "Seconds a publish request spends in the engine (with flush = "
            "sync: until the fsync covering it)", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self.fsync_seconds = Histogram(
            "broker_fsync_seconds", "Seconds each fsync of the commit log took", registry=r,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
        self.groups = Gauge("broker_groups", "Consumer groups the broker holds (at most max_groups)",
                            registry=r)
        self.user_groups = Gauge("broker_user_groups", "New groups each user made on this server (at most "
                                 "max_groups_per_user; admins unbounded)", ["user"], registry=r)
        self.user_topics = Gauge("broker_user_topics", "New topics each user named on this server (at "
                                 "most max_topics_per_user; admins unbounded)", ["user"], registry=r)
        self.lag_source: Callable[[], Iterable[tuple[str, str, int, int]]] | None = None
        self.user_topics_source: Callable[[], Mapping[str, int]] | None = None
        self.unacked = Gauge("broker_unacked_bytes", "Bytes of messages (bodies, keys, headers) the open "
                             "connections hold unacknowledged (each at most max_unacked_bytes)", registry=r)
        self.unacked_source: Callable[[], int] | None = None
        self.groups_source: Callable[[], int] | None = None
        self.user_groups_source: Callable[[], Mapping[str, int]] | None = None

    def exposition(self) -> bytes:
        if self.lag_source is not None:  # lag is read from the engine when scraped
            for group, topic, queue, lag in self.lag_source():
                self.lag.labels(group, topic, str(queue)).set(lag)
        if self.groups_source is not None:
            self.groups.set(self.groups_source())
        if self.user_groups_source is not None:
            for user, made in self.user_groups_source().items():
                self.user_groups.labels(user).set(made)
        if self.unacked_source is not None:
            self.unacked.set(self.unacked_source())
        if self.user_topics_source is not None:
            for user, made in self.user_topics_source().items():
                self.user_topics.labels(user).set(made)
        return generate_latest(self.registry)

    def count_deliveries(self, deliveries: Sequence[Delivery]) -> None:
        """Messages, bytes and redeliveries handed out, one increment per topic (not per message);
        counted by mapping over fields (in C), the topics of a fetch being one as a rule."""
        topics = set(map(_topic, deliveries))
        per_topic = ([(topics.pop(), deliveries)] if len(topics) == 1 else
                     [(topic, [d for d in deliveries if d.topic == topic]) for topic in topics])
        for topic, given in per_topic:
            self.delivered.labels(topic).inc(len(given))
            self.bytes_out.labels(topic).inc(sum(map(len, map(_body, given))))
            if again := _redeliveries(map(_delivery_count, given)):
                self.redelivered.labels(topic).inc(again)

    def count_columns(self, taken: DeliveryColumns) -> None:
        """`count_deliveries` of a fetch taken column by column."""
        if not taken.count:
            return
        if "topic" in taken.same:  # a fetch of one topic: no look at single rows
            if "delivery_count" in taken.same:  # all first deliveries, or all redelivered as often
                again = taken.count if taken.same["delivery_count"] > _FIRST_DELIVERY else 0
            else:
                again = _redeliveries(taken.columns["delivery_count"])
            self._count(taken.same["topic"], taken.count, _column(taken, "body"), again)
            return
        topics, bodies = taken.columns["topic"], _column(taken, "body")
        counts = _column(taken, "delivery_count")
        for topic in set(topics):
            rows = [index for index, named in enumerate(topics) if named == topic]
            self._count(topic, len(rows), [bodies[i] for i in rows],
                        _redeliveries([counts[i] for i in rows]))

    def _count(self, topic: str, count: int, bodies: Sequence[bytes], again: int) -> None:
        """Count ``count`` deliveries of ``topic``, ``again`` of them redeliveries."""
        self.delivered.labels(topic).inc(count)
        self.bytes_out.labels(topic).inc(sum(map(len, bodies)))
        if again:
            self.redelivered.labels(topic).inc(again)

    def totals(self) -> dict[str, float]:  # int where the value is whole
        """Each counter and gauge summed over its labels (``reliable broker stats``)."""
        sums: dict[str, float] = {}
        for metric in (self.published, self.duplicates, self.delivered, self.redelivered,
                       self.dead_lettered, self.bytes_in, self.bytes_out, self.connections,
                       self.open, self.refused, self.auth_failures, self.auth_refused,
                       self.auth_lockouts):
            for family in metric.collect():
                total = float(sum(s.value for s in family.samples if not s.name.endswith("_created")))
                sums[family.name.removeprefix("broker_")] = int(total) if total.is_integer() else total
        return sums

    async def serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one HTTP request: ``GET /metrics`` gets the exposition, anything else 404."""
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            found = request.split(b" ", 2)[:2] == [b"GET", b"/metrics"]
            body = await asyncio.to_thread(self.exposition) if found else b"not found\n"
            status = b"200 OK" if found else b"404 Not Found"
            kind = CONTENT_TYPE_LATEST.encode() if found else b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind +
                         b"\r\nContent-Length: " + str(len(body)).encode() +
                         b"\r\nConnection: close\r\n\r\n" + body)
            await asyncio.wait_for(writer.drain(), 10)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


def _redeliveries(delivery_counts: Iterable[int]) -> int:
    """How many of these deliveries are not the first of their message."""
    return sum(map(_FIRST_DELIVERY.__lt__, delivery_counts))


def _column(taken: DeliveryColumns, name: str) -> Sequence[Any]:
    """The values of field ``name`` of every delivery of ``taken``."""
    found = taken.columns.get(name)
    return found if found is not None else [taken.same[name]] * taken.count
