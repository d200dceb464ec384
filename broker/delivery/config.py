"""The delivery engine's settings (`DeliveryConfig`), checked when built."""

from __future__ import annotations

from dataclasses import dataclass, fields

from broker.errors import BrokerConfigError


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
    """Most message ids remembered (the oldest are forgotten first)."""
    max_deliveries: int = -1
    """Deliveries after which a nacked message goes to ``%DLQ%<group>`` (-1: the consumer decides)."""
    read_batch: int = 256
    """Messages read from the store per queue at a time (paging: nothing more is held)."""
    offset_flush_interval: float = 1.0
    """Seconds between writes of the groups' committed offsets to disk."""
    allocation: str = "averagely"
    """How a group's queues are spread over its members (see `broker.delivery.allocation`)."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "allocation":
                from broker.delivery.allocation import STRATEGIES

                if value not in STRATEGIES:
                    raise BrokerConfigError(
                        f"delivery setting allocation={value!r}: expected one of {', '.join(STRATEGIES)}")
                continue
            low = -1 if spec.name == "max_deliveries" else (1 if spec.type == "int" else 0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (
                spec.type == "float" and value == 0 and spec.name != "offset_flush_interval"
            ):
                raise BrokerConfigError(
                    f"delivery setting {spec.name}={value!r}: expected a number >= {low}"
                    + (" and > 0" if spec.type == "float" else ""))
