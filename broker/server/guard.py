"""Authentication for both listeners, against password guessing: slow to fail, a few checks at once.

A password check (scrypt, about 50-100 ms of CPU) is what a guessing client
costs the server, and each answer is what it gains. So, as mature brokers do:

* a failed authentication is answered only after ``auth_failure_delay``
  seconds (Kafka's ``connection.failed.authentication.delay.ms``); the
  connection waits on the event loop's timer, holding no thread and no check;
* at most ``auth_concurrency`` checks run at once, on threads of their own;
  the attempts waiting for one take turns by client address
  (`broker.server.turns`), so a flood from one address delays a client from
  another by one check.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from broker.protocol.errors import AuthenticationError
from broker.server.auth import Authenticator, Principal
from broker.server.config import Limits
from broker.server.connection import Connection
from broker.server.metrics import ServerMetrics
from broker.server.turns import Turns


class AuthGuard:
    """Checks each connection's credentials (`authenticate`); owns the threads that do it."""

    def __init__(self, authenticator: Authenticator, limits: Limits, metrics: ServerMetrics) -> None:
        self.authenticator, self.metrics = authenticator, metrics
        self.delay = limits.auth_failure_delay
        self.turns = Turns(limits.auth_concurrency)
        self._threads = ThreadPoolExecutor(limits.auth_concurrency, thread_name_prefix="broker-auth")
        metrics.auth_checks.set_function(lambda: self.turns.busy + self.turns.waiting)

    @property
    def required(self) -> bool:
        return self.authenticator.required

    async def authenticate(self, conn: Connection, login: str | None, password: str | None) -> Principal:
        """The principal of these credentials; `AuthenticationError` (after the delay) if they are
        wrong or missing."""
        if not self.required:
            return self.authenticator.authenticate(login, password)
        try:
            return await self._check(conn, login, password)
        except AuthenticationError:
            await asyncio.sleep(self.delay)  # without its turn: the delay holds no check
            raise

    async def _check(self, conn: Connection, login: str | None, password: str | None) -> Principal:
        async with self.turns.turn(conn.host or ""):
            try:
                return await self._verify(login, password)
            except AuthenticationError:
                self.metrics.auth_failures.labels(conn.listener).inc()
                conn.log.warning("authentication_failed", user=(login or "")[:100], address=conn.host)
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

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
