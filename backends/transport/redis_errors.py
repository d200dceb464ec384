"""What an error of redis-py means to `redis://`: an outage, writes refused for now, or a refusal.

Redis answers some commands with an error that only says "not now": ``BUSY``
(another client's script ran past ``busy-reply-threshold``; only ``SCRIPT
KILL`` or its end helps), ``LOADING`` (a restart reading its data),
``READONLY`` (a replica, during a failover), ``MASTERDOWN``, ``TRYAGAIN``,
``CLUSTERDOWN``, ``NOREPLICAS``. Taken for a refusal (a `TransportError`),
one of them met by an ack ended the worker, and one met by a nack had a
failing message dead-lettered as if its retry copy could never be sent. They
are outages: the worker leaves its group, waits its backoff and joins again.
``OOM`` (``maxmemory`` reached) refuses writes for now, as a full disk does.
"""

from __future__ import annotations

import redis

from backends.errors import (
    BackendUnavailableError,
    ReliableError,
    TransportError,
    WritesRefusedError,
)

NOT_NOW = ("BUSY", "MASTERDOWN", "CLUSTERDOWN", "NOREPLICAS")
"""Error codes of a server that cannot serve a command now but will, which redis-py has no class for."""
PASSING = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
           redis.exceptions.TryAgainError)
"""redis-py's classes of the same (``LOADING`` is a `redis.BusyLoadingError`, a ``ConnectionError``)."""


def translate(exc: redis.RedisError, url: str) -> ReliableError:
    """Our error for ``exc``, met by the transport at ``url`` (redacted)."""
    if isinstance(exc, PASSING) or server_code(exc) in NOT_NOW:
        return BackendUnavailableError(f"Redis transport {url} is unreachable: {exc}")
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return WritesRefusedError(f"Redis transport {url} refuses writes (maxmemory reached): {exc}")
    return TransportError(f"Redis transport {url}: {exc}")


def server_code(exc: redis.RedisError) -> str:
    """The code a server error starts with (``BUSY``), also inside redis-py's words for a pipeline's
    failed command ("Command # 1 (...) of pipeline caused error: BUSY ...")."""
    words = str(exc).rpartition("caused error: ")[2]
    return words.split(" ", 1)[0]
