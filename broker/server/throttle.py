"""Throttling authentication: a growing lock-out after repeated failures, per key (a user name, an address).

Shared by the broker server's listeners (`broker.server.guard`, per address)
and the web console's log-in (`broker.console.throttle`, per user name and
per address).

After ``max_failures`` failed attempts for one key within ``window`` seconds,
the key is locked out for ``lockout`` seconds, doubling with each further
failure up to ``max_lockout``; while locked, an attempt is refused before any
password is checked. An attempt is counted when it is admitted, not when its
check ends, so concurrent attempts cannot slip past the limit; a success
forgets the key. A key's failures are forgotten ``window`` seconds after its
last failure or lock-out ended.

A caller that bounds concurrent attempts otherwise (the broker server, whose
services open many connections at once from one address) asks only whether a
key is `locked` and counts each `fail`; it never forgets failures on a success.

The keys kept are bounded (``tracked``): the least recently failed go first,
so a client sending millions of distinct user names cannot grow memory, and
each is a fixed-size digest, whatever the length of the name it stands for.
Nothing here knows HTTP: `client_address` reads a request's address given its
peer and ``X-Forwarded-For``, which it believes only from a trusted proxy.
"""

from __future__ import annotations

import hashlib
import ipaddress
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from broker.store.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger("broker.server")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(slots=True)
class _Record:
    failures: int = 0
    under_way: int = 0  # admitted attempts whose check has not ended
    last: float = 0.0  # the last failure, or the end of the lock-out if later
    locked_until: float = 0.0


class Throttle:
    """Failed attempts per key (a user name, an address) and the lock-outs they earn."""

    def __init__(self, kind: str, max_failures: int, window: float, lockout: float, max_lockout: float,
                 tracked: int, clock: Clock = SYSTEM_CLOCK, event: str | None = None) -> None:
        """``event``: the log event of a lock-out (None: the caller logs what `fail` returns)."""
        self.kind, self.max_failures, self.window, self.clock = kind, max_failures, window, clock
        self.event = event
        self.lockout, self.max_lockout, self.tracked = lockout, max_lockout, tracked
        self._records: OrderedDict[bytes, _Record] = OrderedDict()  # least recently failed first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def admit(self, key: str) -> float:
        """0.0, the attempt counted as under way; else the seconds to wait before another (none counted)."""
        digest, now = _digest(key), self.clock.monotonic()
        with self._lock:
            record = self._current(digest, now)
            if record.locked_until > now:
                return record.locked_until - now
            if record.under_way >= max(self.max_failures - record.failures, 1):
                return 1.0  # the attempts under way end in a lock-out or a success within a moment
            record.under_way += 1
            return 0.0

    def settle(self, key: str, succeeded: bool | None) -> None:
        """End an admitted attempt: a success forgets the key, a failure counts (None: nothing checked)."""
        digest, now = _digest(key), self.clock.monotonic()
        with self._lock:
            record = self._records.get(digest)
            if record is None:  # pushed out meanwhile by other keys
                return
            record.under_way = max(record.under_way - 1, 0)
            if succeeded:
                del self._records[digest]
            elif succeeded is False:
                self._fail(digest, record, now)

    def locked(self, key: str) -> float:
        """The seconds ``key`` stays locked out (0.0: it is not); counts nothing."""
        now = self.clock.monotonic()
        with self._lock:
            record = self._records.get(_digest(key))
            return max(record.locked_until - now, 0.0) if record is not None else 0.0

    def fail(self, key: str) -> float:
        """Count a failure of an attempt `admit` did not count; the seconds of the lock-out it starts
        (0.0: none)."""
        digest, now = _digest(key), self.clock.monotonic()
        with self._lock:
            return self._fail(digest, self._current(digest, now), now)

    def _current(self, digest: bytes, now: float) -> _Record:
        """The key's record, new if it had none or its failures are forgotten by now."""
        record = self._records.get(digest)
        if record is not None and record.under_way == 0 and now >= record.last + self.window:
            del self._records[digest]
            record = None
        if record is None:
            self._bound(now)
            record = self._records[digest] = _Record(last=now)
        return record

    def _fail(self, digest: bytes, record: _Record, now: float) -> float:
        record.failures += 1
        record.last = now
        self._records.move_to_end(digest)
        beyond = record.failures - self.max_failures
        if beyond >= 0:
            seconds = min(self.lockout * 2.0 ** min(beyond, 64), self.max_lockout)
            record.locked_until = record.last = now + seconds
            if self.event is not None:
                log.warning(self.event, by=self.kind, failures=record.failures, seconds=seconds)
            return seconds
        return 0.0

    def _bound(self, now: float) -> None:
        """Make room for one more key: drop the expired from the front, and the least recently
        failed while ``tracked`` are kept."""
        while self._records:
            digest, oldest = next(iter(self._records.items()))
            if len(self._records) < self.tracked and (oldest.under_way or now < oldest.last + self.window):
                return
            del self._records[digest]


def client_address(peer: str, forwarded: str | None, trusted: Sequence[Network]) -> str:
    """The address to throttle: the peer's, or behind a trusted proxy the nearest untrusted address
    of ``X-Forwarded-For`` (what precedes it could be forged by the client). An IPv6 address
    counts as its /64, which one client usually holds whole."""
    address = _parse(peer)
    if address is not None and forwarded and any(address in net for net in trusted):
        for hop in reversed(forwarded.split(",")):
            candidate = _parse(hop.strip())
            if candidate is None:
                break  # garbled: believe no hop beyond it
            address = candidate
            if not any(candidate in net for net in trusted):
                break
    if address is None:
        return peer
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def _parse(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(errors="surrogatepass"), digest_size=16).digest()
