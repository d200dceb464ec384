"""The growing waits of a loop that retries on its own: a worker, a relay, a listener reconnecting.

Built on tenacity's wait strategies (`wait_exponential` by default), slept on
the injected clock and cut short by a stop event. Defined here, below
`reliable`, so the backends' own reconnect loops (PostgreSQL's ``LISTEN``) wait
the same way as the framework's (`reliable.retry` re-exports it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tenacity import RetryCallState, Retrying, wait_exponential
from tenacity.wait import wait_base

from backends.clock import Clock, wait_unless


class Backoff:
    """The growing waits of a caller whose loop retries on its own (a worker reconnecting).

    The worker's poll loop is the retry loop: each failed call asks `failed`
    for the next wait, which is tenacity's ``wait`` for the number of failures
    in a row, slept on the clock; a success starts the count again.
    """

    def __init__(self, clock: Clock, wait: wait_base | None = None) -> None:
        self._clock = clock
        self._wait = wait or wait_exponential(multiplier=0.1, max=5.0)
        self._state = RetryCallState(Retrying(), None, (), {})
        self._state.attempt_number = 0

    @property
    def failures(self) -> int:
        """Failures in a row."""
        return self._state.attempt_number

    def failed(self, before_sleep: Callable[[int, float], Any] | None = None,
               stopping: threading.Event | None = None) -> float:
        """Count a failure and sleep the wait it earns (``before_sleep(failures, wait)`` first),
        cut short once ``stopping`` is set: Ctrl-C during an outage stops at once, not after 5 s."""
        self._state.attempt_number += 1
        delay = float(self._wait(self._state))
        if before_sleep is not None:
            before_sleep(self._state.attempt_number, delay)
        wait_unless(self._clock, delay, stopping)
        return delay

    def succeeded(self) -> int:
        """Start counting again; returns the failures there had been in a row."""
        failures, self._state.attempt_number = self._state.attempt_number, 0
        return failures
