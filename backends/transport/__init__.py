"""Transports, chosen by URL: ``memory://``, ``embedded://PATH``, ``redis://``, ``kafka://``,
``nats://``, ``amqp://``, ``reliable://``.

``open_transport(url, clock, **options)`` builds one. Options common to every
transport: ``queues`` (queues per new topic, default 4) and
``visibility_timeout`` (seconds a fetched message stays leased, default 30).
Options may also be given in the URL's query string
(``embedded://./.reliable/broker?visibility_timeout=10``); keyword options win.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import ConfigurationError, UnsupportedURLError
from backends.transport.base import Transport
from backends.transport.memory import MemoryTransport

__all__ = ["SCHEMES", "MemoryTransport", "Transport", "open_transport"]

# scheme -> (module, class, what the constructor takes first besides the clock):
# "url" the URL without its query, "location" the part after ``scheme://``, "none" nothing
_TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "memory": ("backends.transport.memory", "MemoryTransport", "none"),
    "embedded": ("backends.transport.embedded", "EmbeddedTransport", "location"),
    "redis": ("backends.transport.redis_streams", "RedisStreamsTransport", "url"),
    "kafka": ("backends.transport.kafka", "KafkaTransport", "url"),
    "nats": ("backends.transport.nats_transport", "NatsTransport", "url"),
    "amqp": ("backends.transport.amqp_transport", "AmqpTransport", "url"),
    "reliable": ("backends.transport.remote", "RemoteBrokerTransport", "url"),
}
SCHEMES = tuple(_TRANSPORTS)
DEFAULT_EMBEDDED_PATH = ".reliable/broker"

# option name -> how a query-string value is read
_OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "queues": int,
    "visibility_timeout": float,
    "session_timeout": float,
    "max_deliveries": int,
    "connect_timeout": float,
    "publish_retry": float,
}


def open_transport(url: str, clock: Clock = SYSTEM_CLOCK, **options: Any) -> Transport:
    """The transport ``url`` names, with ``options`` passed to its constructor.

    Raises `UnsupportedURLError` for an unknown scheme and `ConfigurationError`
    for an option the transport does not take or a bad value.
    """
    scheme, separator, rest = url.partition("://")
    if not separator or scheme not in _TRANSPORTS:
        allowed = ", ".join(f"{name}://" for name in SCHEMES)
        raise UnsupportedURLError(
            f"unsupported transport URL {url!r}: allowed schemes are {allowed}"
        )
    module, name, first = _TRANSPORTS[scheme]
    location, _, query = rest.partition("?")
    options = {**_query_options(url, query), **options}
    cls = getattr(importlib.import_module(module), name)
    if first == "none":
        if location:
            raise ConfigurationError(f"transport {url!r}: {scheme}:// takes no location")
        return _build(url, cls, [clock], options)
    if first == "location":
        return _build(url, cls, [location or DEFAULT_EMBEDDED_PATH, clock], options)
    return _build(url, cls, [url.partition("?")[0], clock], options)


def _build(url: str, cls: type[Transport], args: list[Any], options: dict[str, Any]) -> Transport:
    """``cls(*args, **options)``, naming any option ``cls`` does not take."""
    accepted = [
        name
        for name, parameter in inspect.signature(cls).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigurationError(
            f"transport {url!r}: unknown option(s) {', '.join(unknown)} (allowed: {', '.join(accepted)})"
        )
    return cls(*args, **options)


def _query_options(url: str, query: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        reader = _OPTION_TYPES.get(name, str)
        try:
            options[name] = reader(value)
        except ValueError as exc:
            raise ConfigurationError(f"transport {url!r}: option {name}={value!r}: {exc}") from exc
    return options
