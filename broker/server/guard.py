"""Authentication for both listeners, against password guessing: slow to fail, locked per address.

A password check (scrypt, about 50-100 ms of CPU) is what a guessing client
costs the server, and each answer is what it gains. So, as mature brokers do:

* a failed authentication is answered only after ``auth_failure_delay``
  seconds (Kafka's ``connection.failed.authentication.delay.ms``); the
  connection waits on the event loop's timer, holding no thread and no check;
* ``auth_max_failures`` failures from one client address within
  ``auth_window`` seconds lock that address out for ``auth_lockout`` seconds,
  doubling with each further failure up to ``auth_max_lockout``: its
  connections are refused before any password is checked, the right one too.
  The count is per address, never per user name: the broker's users are
  mostly services, and a lock-out by name would let anyone lock a production
  consumer out. A success does not forget the address's failures (one valid
  account must not buy unlimited guesses at the others);
* at most ``auth_concurrency`` checks run at once, on threads of their own;
  the attempts waiting for one take turns by client address
  (`broker.server.turns`), so a flood from one address delays a client from
  another by one check.

The addresses are kept by `broker.server.throttle.Throttle` (an IPv6 client
counts as its /64; at most ``auth_tracked`` of them). Some are never locked,
only delayed and bounded: ``auth_shared_addresses`` (a load balancer or NAT
gateway many clients come through: locking it would lock them all out), and
a unix socket's clients (no address; only this machine's user can connect).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from broker.protocol.errors import AuthenticationError, LockedOutError
from broker.server.auth import Authenticator, Principal
from broker.server.config import Limits
from broker.server.connection import Connection
from broker.server.metrics import ServerMetrics
from broker.server.throttle import Throttle, client_address
from broker.server.turns import Turns
from broker.store.clock import SYSTEM_CLOCK, Clock


class AuthGuard:
    """Checks each connection's credentials (`authenticate`); owns the threads that do it."""

    def __init__(self, authenticator: Authenticator, limits: Limits, metrics: ServerMetrics,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.authenticator, self.metrics, self.clock = authenticator, metrics, clock
        self.delay = limits.auth_failure_delay
        self.addresses = Throttle("address", limits.auth_max_failures, limits.auth_window, limits.auth_lockout,
                                  limits.auth_max_lockout, limits.auth_tracked, clock)
        self.shared = limits.shared_networks
        self.turns = Turns(limits.auth_concurrency)
        self._threads = ThreadPoolExecutor(limits.auth_concurrency, thread_name_prefix="broker-auth")
        metrics.auth_checks.set_function(lambda: self.turns.busy + self.turns.waiting)

    @property
    def required(self) -> bool:
        return self.authenticator.required

    async def authenticate(self, conn: Connection, login: str | None, password: str | None) -> Principal:
        """The principal of these credentials; `AuthenticationError` (after the delay) if they are
        wrong or missing, or the connection's address is locked out."""
        if not self.required:
            return self.authenticator.authenticate(login, password)
        try:
            return await self._check(conn, self._lockable(conn), login, password)
        except AuthenticationError:
            await asyncio.sleep(self.delay)  # without its turn: the delay holds no check
            raise

    def _lockable(self, conn: Connection) -> str | None:
        """The address ``conn``'s failures are counted under; None: it is never locked out."""
        if conn.host is None:
            return None
        try:
            address = ipaddress.ip_address(conn.host.partition("%")[0])  # without an IPv6 zone
        except ValueError:
            return conn.host
        address = getattr(address, "ipv4_mapped", None) or address
        if any(address in net for net in self.shared):
            return None
        return client_address(conn.host, None, ())  # an IPv6 address counts as its /64

    async def _check(self, conn: Connection, address: str | None, login: str | None,
                     password: str | None) -> Principal:
        self._refuse_if_locked(conn, address, login)
        async with self.turns.turn(address or conn.host or ""):
            self._refuse_if_locked(conn, address, login)  # locked while this attempt waited its turn
            try:
                return await self._verify(login, password)
            except AuthenticationError:
                self._failed(conn, address, login)
                raise

    async def _verify(self, login: str | None, password: str | None) -> Principal:
        """scrypt on the guard's threads; if the caller is cancelled, its turn lasts until the
        thread is free again (the threads never hold more than the turns allow)."""
        checking = asyncio.get_running_loop().run_in_executor(
            self._threads, self.authenticator.authenticate, login, password)
        try:
            return await asyncio.shield(checking)
        except asyncio.CancelledError:
            await asyncio.wait([checking])
            raise

    def _refuse_if_locked(self, conn: Connection, address: str | None, login: str | None) -> None:
        seconds = self.addresses.locked(address) if address is not None else 0.0
        if not seconds:
            return
        self.metrics.auth_refused.labels(conn.listener).inc()
        conn.log.warning("authentication_refused", reason="locked_out", address=address,
                         user=(login or "")[:100], seconds=round(seconds, 3))
        until = datetime.fromtimestamp(self.clock.time() + seconds, UTC).strftime("%H:%M:%S UTC")
        raise LockedOutError(f"too many failed authentications from {address}: refused for "
                             f"{math.ceil(seconds)} s more (until {until}), whatever the credentials",
                             retry_after=seconds)

    def _failed(self, conn: Connection, address: str | None, login: str | None) -> None:
        self.metrics.auth_failures.labels(conn.listener).inc()
        conn.log.warning("authentication_failed", user=(login or "")[:100], address=address or conn.host)
        seconds = self.addresses.fail(address) if address is not None else 0.0
        if seconds:
            self.metrics.auth_lockouts.labels(conn.listener).inc()
            conn.log.warning("authentication_locked_out", address=address, seconds=seconds,
                             max_failures=self.addresses.max_failures, window=self.addresses.window)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
