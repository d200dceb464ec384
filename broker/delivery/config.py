"""The delivery engine's settings (`DeliveryConfig`), checked when built."""

from __future__ import annotations

from dataclasses import dataclass, fields

from broker.delivery.allocation import STRATEGIES
from broker.delivery.selection import (
    LATENCY_MAX,
    NOT_AVAILABLE_DURATION,
    LatencyAware,
    LatencyTable,
    QueueSelector,
    RoundRobin,
)
from broker.errors import BrokerConfigError
from broker.store import Clock

SELECTIONS = ("round_robin", "latency_aware")
"""The values of ``selection`` (see `broker.delivery.selection`)."""


@dataclass(frozen=True)
class DeliveryConfig:
    """How topics, groups and deliveries behave; every value is checked in ``__post_init__``."""

    queues: int = 4
    """Queues of a topic created by its first publish."""
    lease: float = 30.0
    """Seconds a delivered message stays with its member before it is redelivered."""
    session_timeout: float = 30.0
    """Seconds of silence after which a member is presumed dead and its queues move."""
    prefetch: int = 1000
    """Most messages a member holds unacknowledged (``DELIVERED`` acks do not count)."""
    dedup_window: float = 600.0
    """Seconds a producer's message id is remembered, so a resend is dropped."""
    dedup_entries: int = 200_000
    """Message ids always remembered: an id is forgotten once this many came after it (or its
    window passed); memory holds at most twice this many."""
    max_deliveries: int = -1
    """Deliveries after which a message goes to ``%DLQ%<group>`` when its last one ends without an
    ack (a nack, its lease expiring, its member leaving); -1: the consumer decides."""
    max_groups: int = 10_000
    """Consumer groups the engine holds at most (RabbitMQ's per-vhost ``max-queues``): past it a join
    of a new group name is refused (`TooManyGroupsError`); members of existing groups still join.
    A group is never deleted and keeps its cursors when its members leave (about 10 KB each)."""
    max_topics: int = 10_000
    """Topics (not counting groups' ``%RETRY%`` and ``%DLQ%``, which ``max_groups`` bounds) the
    engine holds at most: past it a publish to a new topic name is refused (`TooManyTopicsError`);
    topics that exist take messages still. Each queue a topic used keeps a file open and mapped
    (a file descriptor and a memory map of the process: 65,530 maps by default on Linux), so a
    user allowed ``orders.*`` publishing to a new name each time made the broker fail for all."""
    read_batch: int = 256
    """Messages read from the store per queue at a time (paging: nothing more is held)."""
    max_fetch_bytes: int = 16 * 1024 * 1024
    """Bytes of messages (their stored records) one fetch or read hands out at most, whatever the
    count asked for; at least one message, however large (Kafka's ``fetch.max.bytes``)."""
    offset_flush_interval: float = 1.0
    """Seconds between writes of the groups' committed offsets to disk."""
    allocation: str = "averagely"
    """How a group's queues are spread over its members (see `broker.delivery.allocation`)."""
    selection: str = "round_robin"
    """How a message without a key or an asked-for queue finds its queue: ``round_robin`` or
    ``latency_aware`` (queues whose appends were slow or failed are avoided for a while)."""
    latency_max: tuple[float, ...] = LATENCY_MAX
    """With ``latency_aware``: append latencies (seconds, increasing) from which a queue is paused."""
    not_available_duration: tuple[float, ...] = NOT_AVAILABLE_DURATION
    """With ``latency_aware``: how long (seconds) each ``latency_max`` threshold pauses a queue."""

    def __post_init__(self) -> None:
        _choice("allocation", self.allocation, tuple(STRATEGIES))
        _choice("selection", self.selection, SELECTIONS)
        _latency_table(self.latency_max, self.not_available_duration)
        for spec in fields(self):
            if spec.type not in ("int", "float"):
                continue
            value = getattr(self, spec.name)
            low = -1 if spec.name == "max_deliveries" else (1 if spec.type == "int" else 0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (
                spec.type == "float" and value == 0 and spec.name != "offset_flush_interval"
            ):
                raise BrokerConfigError(
                    f"delivery setting {spec.name}={value!r}: expected a number >= {low}"
                    + (" and > 0" if spec.type == "float" else ""))

    def queue_selector(self, clock: Clock) -> QueueSelector:
        """The selector ``selection`` names, on ``clock``."""
        if self.selection == "latency_aware":
            return LatencyAware(clock, LatencyTable(self.latency_max, self.not_available_duration))
        return RoundRobin()


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise BrokerConfigError(f"delivery setting {name}={value!r}: expected one of {', '.join(allowed)}")


def _latency_table(latency_max: tuple[float, ...], durations: tuple[float, ...]) -> None:
    def numbers(value: tuple[float, ...]) -> bool:
        return isinstance(value, tuple) and bool(value) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)

    if not numbers(latency_max) or list(latency_max) != sorted(set(latency_max)):
        raise BrokerConfigError(f"delivery setting latency_max={latency_max!r}: expected a non-empty "
                                "tuple of increasing numbers of seconds >= 0")
    if not numbers(durations) or len(durations) != len(latency_max):
        raise BrokerConfigError(f"delivery setting not_available_duration={durations!r}: expected a "
                                f"tuple of {len(latency_max)} numbers of seconds >= 0, one per latency_max")
