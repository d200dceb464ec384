"""The web console's log-in throttle: an attempt must be admitted by user name and by address.

The lock-outs themselves are `broker.server.throttle.Throttle`'s, shared with
the broker server's listeners; the console, whose users are people, also
counts per user name (the broker server, whose users are services, does not).
"""

from __future__ import annotations

import math

from broker.server.throttle import Throttle
from broker.store.clock import SYSTEM_CLOCK, Clock

LOCKED = "console.login_locked"
"""The log event of a lock-out earned by failed log-ins."""


class LoginThrottle:
    """Log-in attempts throttled by user name and by client address: both must admit an attempt."""

    def __init__(self, max_failures: int, max_failures_per_address: int, window: float, lockout: float,
                 max_lockout: float, tracked: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self.by_user = Throttle("user", max_failures, window, lockout, max_lockout, tracked, clock, LOCKED)
        self.by_address = Throttle("address", max_failures_per_address, window, lockout, max_lockout, tracked,
                                   clock, LOCKED)

    def admit(self, user: str, address: str) -> float:
        """0.0 (the attempt is under way: `settle` it) or the seconds to wait before trying again."""
        wait = self.by_user.admit(user)
        if wait:
            return wait
        wait = self.by_address.admit(address)
        if wait:
            self.by_user.settle(user, None)
        return wait

    def settle(self, user: str, address: str, succeeded: bool | None) -> None:
        """A success forgets the user name's failures, not the address's: an account of one's own
        logged in every few guesses reset the address's count, so its bound on trying one password
        over many user names held no one who had an account."""
        self.by_user.settle(user, succeeded)
        self.by_address.settle(address, False if succeeded is False else None)


def retry_after(seconds: float) -> int:
    """Whole seconds for a ``Retry-After`` header (never 0: the client must wait)."""
    return max(math.ceil(seconds), 1)
