"""Which connections the listeners take: at most ``max_connections``, and so many per client address.

``max_connections`` alone let one client address fill the server: connections
opened and never authenticated each hold a slot for ``handshake_timeout``,
again and again, and every other client is refused meanwhile. So, as Kafka's
``max.connections.per.ip`` (with ``max.connections.per.ip.overrides``) and
NATS's and RabbitMQ's connection limits do, one address holds at most
``max_connections_per_address`` connections of both listeners together; an
address behind which many clients connect (a load balancer, a NAT gateway)
gets its own cap from ``max_connections_per_address_overrides``.

A connection is admitted or refused when it is accepted, before a byte of it
is read. An IPv6 client counts as its /64 (which one client usually holds
whole), as the authentication lock-outs count it; a unix socket's clients
have no address and only the global cap applies to them. A refusal is
counted per listener and reason (``broker_connections_refused_total``), and
logged once per address (or for the global cap, once) per
``REFUSALS_LOGGED_EVERY`` seconds with the number refused since: a flood of
refusals is one line a minute, not one per connection.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import structlog
from prometheus_client import Counter

from broker.protocol.errors import ConnectionLimitError
from broker.server.config import Limits
from broker.server.throttle import client_address
from broker.store.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger("broker.server")
REFUSALS_LOGGED_EVERY = 60.0
"""Seconds between two log lines about refusals of one address."""
REFUSALS_TRACKED = 10_000
"""Addresses whose last logged refusal is remembered (the oldest go first)."""
EVERYONE = "*"
"""The key the refusals of the global cap are logged under."""


class Refusals(Protocol):
    """Where refusals are counted: ``broker_connections_refused_total`` by listener and reason
    (`broker.server.metrics`)."""

    refused: Counter


@dataclass(frozen=True)
class CapNames:
    """What a refusal names: whose caps they are and the settings that set them."""

    holder: str = "the broker"
    total: str = "max_connections"
    per_address: str = "max_connections_per_address"
    remedy: str = "ask for an override for this address"
    settings: bool = True
    """False: the caps are constants of the code, which no setting changes (the metrics listener's)."""

    def cap(self, name: str, value: int) -> str:
        """How a refusal names a cap: the setting and its value, or a fixed cap."""
        return f"{name}={value}" if self.settings else f"fixed cap of {value} {name} (no setting changes it)"


class Admission:
    """The connections open per client address, and the decision on each new one (one event loop)."""

    def __init__(self, limits: Limits, metrics: Refusals, clock: Clock = SYSTEM_CLOCK,
                 names: CapNames = CapNames()) -> None:
        self.limits, self.metrics, self.clock, self.names = limits, metrics, clock, names
        self.overrides = limits.address_overrides  # the most specific network first
        self.open = 0
        self._per_address: dict[str, int] = {}
        self._logged: OrderedDict[str, tuple[float, int]] = OrderedDict()  # last line, refused since

    def admit(self, listener: str, host: str | None) -> ConnectionLimitError | None:
        """None: the connection from ``host`` is counted open until `release`; else the refusal to
        send it (counted and logged)."""
        address = _address(host)
        if self.open >= self.limits.max_connections:
            total = self.names.cap(self.names.total, self.limits.max_connections)
            return self._refuse(listener, EVERYONE, "max_connections", ConnectionLimitError(
                f"{self.names.holder} already holds {total if self.names.settings else 'its ' + total}"))
        held = self._per_address.get(address, 0) if address is not None else 0
        if address is not None and held >= (cap := self.cap(host)):
            return self._refuse(listener, address, "per_address", ConnectionLimitError(
                f"{address} already holds {held} connections, "
                f"its {self.names.cap(self.names.per_address, cap)}; "
                f"close some, or {self.names.remedy}"))
        self.open += 1
        if address is not None:
            self._per_address[address] = held + 1
        return None

    def release(self, host: str | None) -> None:
        """An admitted connection from ``host`` has ended."""
        self.open -= 1
        address = _address(host)
        if address is None:
            return
        left = self._per_address.get(address, 0) - 1
        if left > 0:
            self._per_address[address] = left
        else:
            self._per_address.pop(address, None)

    def cap(self, host: str | None) -> int:
        """The connections ``host``'s address may hold: its override's, or the default."""
        try:
            parsed = ipaddress.ip_address((host or "").partition("%")[0])
        except ValueError:
            return self.limits.max_connections_per_address
        parsed = getattr(parsed, "ipv4_mapped", None) or parsed
        for network, cap in self.overrides:
            if parsed in network:
                return cap
        return self.limits.max_connections_per_address

    def _refuse(self, listener: str, key: str, reason: str,
                error: ConnectionLimitError) -> ConnectionLimitError:
        self.metrics.refused.labels(listener, reason).inc()
        now = self.clock.monotonic()
        last, since = self._logged.pop(key, (float("-inf"), 0))
        if now - last >= REFUSALS_LOGGED_EVERY:
            log.warning("connection_refused", reason=reason, address=key, listener=listener,
                        refused=since + 1, error=str(error))
            last, since = now, 0
        else:
            since += 1
        self._logged[key] = (last, since)  # to the end: the most recently refused
        while len(self._logged) > REFUSALS_TRACKED:
            self._logged.popitem(last=False)
        return error


def _address(host: str | None) -> str | None:
    """The key ``host``'s connections are counted under (None: a unix socket's, never counted)."""
    if host is None:
        return None
    return client_address(host.partition("%")[0], None, ())  # an IPv6 address counts as its /64
