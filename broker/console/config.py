"""The console's settings, validated when built: where it listens and how it pages and samples."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.errors import BrokerConfigError


@dataclass(frozen=True)
class ConsoleConfig:
    """``host``/``port`` to bind (port 0: any free one); lag sampled every ``sample_interval`` s."""

    host: str = "127.0.0.1"
    port: int = 8700
    page_size: int = 50
    sample_interval: float = 10.0
    history: float = 3600.0
    session_max_age: int = 8 * 3600
    max_sessions: int = 1000
    max_sessions_per_user: int = 10

    def __post_init__(self) -> None:
        _require("console_port", self.port, int, 0, 65535)
        _require("console_page_size", self.page_size, int, 1, 1000)
        _require("console_sample_interval", self.sample_interval, (int, float), 0.01, 3600)
        _require("console_history", self.history, (int, float), 1, 7 * 86400)
        _require("console_session_max_age", self.session_max_age, int, 60, 30 * 86400)
        _require("console_max_sessions", self.max_sessions, int, 1, 1_000_000)
        _require("console_max_sessions_per_user", self.max_sessions_per_user, int, 1, 1_000_000)

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
        "console_max_sessions_per_user": "max_sessions_per_user"}


def _require(key: str, value: object, kind: type | tuple[type, ...], low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= float(value) <= high:  # type: ignore[arg-type]
        raise BrokerConfigError(f"broker.{key} = {value!r}: must be a number between {low} and {high}")
