"""The console's settings, validated when built: where it listens, how it pages and samples, and how
it bounds sessions and throttles log-ins."""

from __future__ import annotations

import importlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.errors import BrokerConfigError


@dataclass(frozen=True)
class ConsoleConfig:
    """``host``/``port`` to bind (port 0: any free one); lag sampled every ``sample_interval`` s;
    the ``login_*`` limits throttle failed log-ins (`broker.console.throttle`), per user name and
    per client address, read from ``X-Forwarded-For`` only behind one of ``trusted_proxies``; the
    listener holds ``max_connections`` in all and ``max_connections_per_address`` from one peer
    (`broker.console.listener`), each given ``request_timeout`` s to send a request; the session
    cookie is marked Secure (sent over HTTPS only) with ``secure_cookie``, for a console served
    through a TLS proxy."""

    host: str = "127.0.0.1"
    port: int = 8700
    page_size: int = 50
    sample_interval: float = 10.0
    history: float = 3600.0
    session_max_age: int = 8 * 3600
    max_sessions: int = 1000
    max_sessions_per_user: int = 10
    login_max_failures: int = 5
    login_max_failures_per_address: int = 20
    login_window: float = 300.0
    login_lockout: float = 30.0
    login_max_lockout: float = 900.0
    login_tracked: int = 10_000
    login_concurrency: int = 4
    trusted_proxies: tuple[str, ...] = ()
    max_connections: int = 64
    max_connections_per_address: int = 16
    request_timeout: float = 10.0
    secure_cookie: bool = False

    def __post_init__(self) -> None:
        _require("console_port", self.port, int, 0, 65535)
        _require("console_page_size", self.page_size, int, 1, 1000)
        _require("console_sample_interval", self.sample_interval, (int, float), 0.01, 3600)
        _require("console_history", self.history, (int, float), 1, 7 * 86400)
        _require("console_session_max_age", self.session_max_age, int, 60, 30 * 86400)
        _require("console_max_sessions", self.max_sessions, int, 1, 1_000_000)
        _require("console_max_sessions_per_user", self.max_sessions_per_user, int, 1, 1_000_000)
        _require("console_login_max_failures", self.login_max_failures, int, 1, 1000)
        _require("console_login_max_failures_per_address", self.login_max_failures_per_address, int, 1, 100_000)
        _require("console_login_window", self.login_window, (int, float), 1, 7 * 86400)
        _require("console_login_lockout", self.login_lockout, (int, float), 0.1, 86400)
        _require("console_login_max_lockout", self.login_max_lockout, (int, float), self.login_lockout, 7 * 86400)
        _require("console_login_tracked", self.login_tracked, int, 100, 10_000_000)
        _require("console_login_concurrency", self.login_concurrency, int, 1, 64)
        _require("console_max_connections", self.max_connections, int, 1, 100_000)
        _require("console_max_connections_per_address", self.max_connections_per_address, int, 1, 100_000)
        _require("console_request_timeout", self.request_timeout, (int, float), 0.01, 3600)
        if not isinstance(self.secure_cookie, bool):
            raise BrokerConfigError(f"broker.console_secure_cookie = {self.secure_cookie!r}: must be true or false")
        object.__setattr__(self, "trusted_proxies", _networks(self.trusted_proxies))

    @property
    def proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """The ``trusted_proxies`` whose ``X-Forwarded-For`` names the client."""
        return tuple(ipaddress.ip_network(net, strict=False) for net in self.trusted_proxies)

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], host: str = "127.0.0.1") -> ConsoleConfig | None:
        """From the ``[broker]`` table's ``console_*`` keys; None (no console) without ``console_port``.

        ``console_host`` defaults to the broker's ``host``.
        """
        given = {k: v for k, v in table.items() if k.startswith("console_")}
        unknown = set(given) - set(KEYS)
        if unknown:
            raise BrokerConfigError(f"broker: unknown keys {sorted(unknown)}; the console's keys are {sorted(KEYS)}")
        port = given.get("console_port")
        if port is None or port is False:
            if given:
                raise BrokerConfigError(f"broker: {sorted(given)} given without broker.console_port "
                                        "(the console is off until it has a port)")
            return None
        values = {KEYS[k]: v for k, v in given.items()}
        values.setdefault("host", host)
        if not isinstance(values["host"], str):
            raise BrokerConfigError(f"broker.console_host = {values['host']!r}: must be an address")
        return cls(**values)


KEYS = {"console_host": "host", "console_port": "port", "console_page_size": "page_size",
        "console_sample_interval": "sample_interval", "console_history": "history",
        "console_session_max_age": "session_max_age", "console_max_sessions": "max_sessions",
        "console_max_sessions_per_user": "max_sessions_per_user", "console_login_max_failures": "login_max_failures",
        "console_login_max_failures_per_address": "login_max_failures_per_address",
        "console_login_window": "login_window", "console_login_lockout": "login_lockout",
        "console_login_max_lockout": "login_max_lockout", "console_login_tracked": "login_tracked",
        "console_login_concurrency": "login_concurrency", "console_trusted_proxies": "trusted_proxies",
        "console_max_connections": "max_connections",
        "console_max_connections_per_address": "max_connections_per_address",
        "console_request_timeout": "request_timeout", "console_secure_cookie": "secure_cookie"}


def _require(key: str, value: object, kind: type | tuple[type, ...], low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= float(value) <= high:  # type: ignore[arg-type]
        raise BrokerConfigError(f"broker.{key} = {value!r}: must be a number between {low} and {high}")


def _networks(value: object) -> tuple[str, ...]:
    """``console_trusted_proxies``: addresses or networks (``10.0.0.0/8``), checked, as given."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise BrokerConfigError(f"broker.console_trusted_proxies = {value!r}: must be a list of addresses "
                                "or networks (CIDR)")
    for item in value:
        if not isinstance(item, str) or not _is_network(item):
            raise BrokerConfigError(f"broker.console_trusted_proxies: {item!r} is not an address or a network "
                                    "(CIDR)")
    return tuple(value)


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


CONSOLE_PACKAGES = ("starlette", "jinja2", "uvicorn", "itsdangerous")
"""What the console imports beyond the broker's own dependencies (the extra ``reliable[console]``)."""


def require_console_packages() -> None:
    """`BrokerConfigError` naming the missing packages and the extra, before the console is
    imported (it was a ``ModuleNotFoundError`` traceback)."""
    missing = []
    for name in CONSOLE_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise BrokerConfigError(f"the web console needs {', '.join(missing)}: pip install 'reliable[console]'")
