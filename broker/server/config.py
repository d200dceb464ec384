"""The server's configuration: listeners, limits, TLS and users, validated when built.

`ServerConfig.from_mapping` reads the ``[broker]`` table of ``reliable.toml``
(see docs/broker-server.md for every key); a bad value raises
`BrokerConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import ipaddress
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from broker.console.config import ConsoleConfig
from broker.errors import BrokerConfigError
from broker.protocol.codec import DEFAULT_MAX_FRAME_SIZE
from broker.server.auth import Authenticator, User, load_users

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
#: keys of the ``[broker]`` table that configure the engine, not the server
ENGINE_KEYS = frozenset({"data_dir", "flush", "selection", "max_deliveries", "max_fetch_bytes", "max_groups", "max_topics",
                         "retention", "clean_at", "force_at", "refuse_at"})


@dataclass(frozen=True)
class Limits:
    """What one client may cost the server; seconds for the timeouts."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_handshake_frame_size: int = 64 * 1024  # before authentication (native: up to hello; STOMP: CONNECT)
    max_connections: int = 1024
    max_connections_per_address: int = 128  # both listeners together (`broker.server.admission`)
    # networks (CIDR) or addresses, each with a cap of its own for every address in it (a load balancer)
    max_connections_per_address_overrides: Mapping[str, int] = field(default_factory=dict)
    idle_timeout: float = 120.0
    slow_client_timeout: float = 30.0
    handshake_timeout: float = 10.0
    max_fetch_wait: float = 30.0
    stomp_prefetch: int = 100
    stomp_max_redeliveries: int = 6  # ActiveMQ's maximumRedeliveries; then %DLQ%<group>
    stomp_redelivery_delay: float = 1.0  # ActiveMQ's initialRedeliveryDelay, seconds
    stomp_redelivery_multiplier: float = 1.0  # ActiveMQ's backOffMultiplier (1: a constant delay)
    max_fetch_messages: int = 10_000  # messages one reply holds at most (fetch, read, dlq_list, lookup_key)
    max_waiting_requests: int = 64  # per native connection: fetch, read, ... running beside the others
    max_subscriptions: int = 1000  # per connection: native members, STOMP subscriptions (ActiveMQ's default)
    max_groups_per_user: int = 1000  # new groups one user (not an admin) may make (`broker.server.quota`)
    max_topics_per_user: int = 1000  # new topics one user (not an admin) may make (`broker.server.quota`)
    max_transactions: int = 16  # open STOMP transactions per connection
    max_transaction_bytes: int = 16 * 1024 * 1024  # what they may hold together, per connection
    # bodies delivered and not yet acknowledged, per connection (all its members or subscriptions
    # together): past it nothing more is delivered to it until acks free room (at least one message)
    max_unacked_bytes: int = 64 * 1024 * 1024
    # failed authentications (`broker.server.guard`): answered after a delay; past a number per
    # client address within a window, that address is locked out for a time doubling per failure
    auth_failure_delay: float = 0.1  # Kafka's connection.failed.authentication.delay.ms
    auth_max_failures: int = 20
    auth_window: float = 300.0
    auth_lockout: float = 30.0
    auth_max_lockout: float = 300.0
    auth_tracked: int = 10_000  # client addresses remembered (the least recently failed go first)
    auth_concurrency: int = 2  # password checks running at once, on threads of their own
    auth_shared_addresses: tuple[str, ...] = ()  # never locked out: a load balancer, a NAT gateway

    def __post_init__(self) -> None:
        for name in ("max_frame_size", "max_handshake_frame_size", "max_connections", "max_connections_per_address",
                     "stomp_prefetch", "max_fetch_messages", "max_waiting_requests", "max_subscriptions",
                     "max_groups_per_user", "max_topics_per_user", "max_transactions", "max_transaction_bytes", "max_unacked_bytes"):
            _require(f"broker.{name}", getattr(self, name), int, 1)
        for name in ("idle_timeout", "slow_client_timeout", "handshake_timeout", "max_fetch_wait"):
            _require(f"broker.{name}", getattr(self, name), (int, float), 0.001)
        _require("broker.stomp_max_redeliveries", self.stomp_max_redeliveries, int, 0)
        _require("broker.stomp_redelivery_delay", self.stomp_redelivery_delay, (int, float), 0)
        _require("broker.stomp_redelivery_multiplier", self.stomp_redelivery_multiplier, (int, float), 1)
        _require("broker.auth_failure_delay", self.auth_failure_delay, (int, float), 0, 60)
        _require("broker.auth_max_failures", self.auth_max_failures, int, 1, 1_000_000)
        _require("broker.auth_window", self.auth_window, (int, float), 1, 7 * 86400)
        _require("broker.auth_lockout", self.auth_lockout, (int, float), 0.1, 86400)
        _require("broker.auth_max_lockout", self.auth_max_lockout, (int, float), self.auth_lockout, 7 * 86400)
        _require("broker.auth_tracked", self.auth_tracked, int, 100, 10_000_000)
        _require("broker.auth_concurrency", self.auth_concurrency, int, 1, 64)
        object.__setattr__(self, "auth_shared_addresses", _networks("broker.auth_shared_addresses",
                                                                    self.auth_shared_addresses))
        _overrides("broker.max_connections_per_address_overrides", self.max_connections_per_address_overrides)

    @property
    def address_overrides(self) -> tuple[tuple[Network, int], ...]:
        """The ``max_connections_per_address_overrides``, parsed, the most specific network first."""
        parsed = [(ipaddress.ip_network(net, strict=False), cap)
                  for net, cap in self.max_connections_per_address_overrides.items()]
        return tuple(sorted(parsed, key=lambda pair: -pair[0].prefixlen))

    @property
    def shared_networks(self) -> tuple[Network, ...]:
        """The ``auth_shared_addresses``, parsed."""
        return tuple(ipaddress.ip_network(net, strict=False) for net in self.auth_shared_addresses)

    @property
    def handshake_frame_size(self) -> int:
        """The largest frame before authentication: ``max_handshake_frame_size``, within ``max_frame_size``."""
        return min(self.max_handshake_frame_size, self.max_frame_size)

    def stomp_nack_delay(self, delivery_count: int) -> float:
        """Seconds before a NACKed message comes back, after its ``delivery_count``-th delivery."""
        return self.stomp_redelivery_delay * self.stomp_redelivery_multiplier ** (delivery_count - 1)


@dataclass(frozen=True)
class TlsConfig:
    """A certificate and key for the listeners; ``cafile`` with ``require_client_cert`` for mutual TLS."""

    certfile: str
    keyfile: str
    cafile: str | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        for name in ("certfile", "keyfile", "cafile"):
            _require_kind(f"broker.tls_{name}", getattr(self, name), str, optional=name == "cafile")
        _require_kind("broker.tls_require_client_cert", self.require_client_cert, bool)

    def context(self) -> ssl.SSLContext:
        """A server context refusing anything older than TLS 1.2."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.cafile)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise BrokerConfigError(
                f"broker.tls_certfile = {self.certfile!r}, broker.tls_keyfile = {self.keyfile!r}: "
                f"cannot load the certificate chain ({exc})") from exc
        if self.require_client_cert:
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass(frozen=True)
class ServerConfig:
    """Where the listeners bind and what they allow; ``None`` port: listener off, 0: any free port."""

    host: str = "127.0.0.1"
    port: int = 7600
    stomp_port: int | None = 61613
    metrics_port: int | None = None
    limits: Limits = field(default_factory=Limits)
    tls: TlsConfig | None = None
    users: Mapping[str, User] = field(default_factory=dict)
    allow_open_network: bool = False
    unix_socket: str | None = None  # a path: the native protocol there too (owner-only access)
    console: ConsoleConfig | None = None  # the web console's listener (``console_port``); off by default

    def __post_init__(self) -> None:
        for name in ("port", "stomp_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None:
                _require(f"broker.{name}", value, int, 0, 65535)
        _require_kind("broker.host", self.host, str)
        _require_kind("broker.allow_open_network", self.allow_open_network, bool)
        _require_kind("broker.unix_socket", self.unix_socket, str, optional=True)
        if not self.users and not self.allow_open_network and not _is_loopback(self.host):
            raise BrokerConfigError(
                f"broker.host = {self.host!r}: a broker without users may only bind a loopback "
                "address; add [broker.users] or set broker.allow_open_network = true")

    def authenticator(self) -> Authenticator:
        return Authenticator(self.users)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ServerConfig:
        """The configuration the ``[broker]`` table describes (engine keys are ignored)."""
        data = dict(data)
        limits = {f.name: data.pop(f.name) for f in fields(Limits) if f.name in data}
        tls = {k: data.pop(f"tls_{k}") for k in ("certfile", "keyfile", "cafile",
                                                   "require_client_cert") if f"tls_{k}" in data}
        users = load_users(data.pop("users", {}))
        if "users_file" in data:
            users.update(_users_file(data.pop("users_file")))
        console = {k: data.pop(k) for k in list(data) if k.startswith("console_")}
        for port in ("stomp_port", "metrics_port"):
            if data.get(port) is False:
                data[port] = None
        allowed = {"host", "port", "stomp_port", "metrics_port", "allow_open_network", "unix_socket"}
        unknown = set(data) - allowed - ENGINE_KEYS
        if unknown:
            raise BrokerConfigError(f"broker: unknown keys {sorted(unknown)}; allowed: "
                                    f"{sorted(allowed | ENGINE_KEYS | set(limits) | {'users', 'users_file', 'console_port'})}")
        if tls and not {"certfile", "keyfile"} <= set(tls):
            raise BrokerConfigError(f"broker.tls_*: {sorted(tls)} given; TLS needs both "
                                    "tls_certfile and tls_keyfile")
        if "data_dir" in data:
            _require_kind("broker.data_dir", data["data_dir"], str)
        server = {k: v for k, v in data.items() if k in allowed}
        return cls(limits=Limits(**limits), tls=TlsConfig(**tls) if tls else None, users=users,
                   console=ConsoleConfig.from_mapping(console, data.get("host", "127.0.0.1")), **server)


def _users_file(path: str) -> dict[str, User]:
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BrokerConfigError(f"broker.users_file = {path!r}: cannot read it ({exc})") from exc
    return load_users(document.get("users", {}), f"{path}: users")


def _require_kind(key: str, value: Any, kind: type, optional: bool = False) -> None:
    if (value is None and optional) or (isinstance(value, kind) and (kind is bool or not isinstance(
            value, bool))):
        return
    raise BrokerConfigError(f"{key} = {value!r}: must be a {kind.__name__}"
                            + (" or absent" if optional else ""))


def _networks(key: str, value: Any) -> tuple[str, ...]:
    """A list of addresses or networks (CIDR), checked, as given."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise BrokerConfigError(f"{key} = {value!r}: must be a list of addresses or networks (CIDR)")
    for item in value:
        try:
            ipaddress.ip_network(item, strict=False)
        except (TypeError, ValueError):
            raise BrokerConfigError(f"{key} = {value!r}: {item!r} is not an address or a network (CIDR)") from None
    return tuple(value)


def _overrides(key: str, value: Any) -> None:
    """A table of addresses or networks (CIDR), each with a number of connections."""
    if not isinstance(value, Mapping):
        raise BrokerConfigError(f"{key} = {value!r}: must be a table of address or network (CIDR) = "
                                'connections, e.g. { "10.0.0.5" = 1024 }')
    _networks(key, list(value))
    for network, cap in value.items():
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise BrokerConfigError(f"{key} = {value!r}: the connections of {network!r} must be a number >= 1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require(key: str, value: Any, kind: type | tuple[type, ...], low: float,
             high: float | None = None) -> None:
    number: float = value if isinstance(value, int | float) else float("nan")
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= number <= (
            float("inf") if high is None else high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise BrokerConfigError(f"{key} = {value!r}: must be a number {bound}")
