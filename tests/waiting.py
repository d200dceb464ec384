"""Waiting in tests: on a condition a real component reports, never for a fixed time.

``wait_until(lambda: ..., "what")`` polls the condition (tenacity's retry on
its result) until it holds and fails the test naming what never happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_exponential

T = TypeVar("T")

WAIT = 30.0
"""Seconds before a condition that never holds fails the test (a loaded machine is slow)."""


def wait_until(condition: Callable[[], T], what: str, timeout: float = WAIT) -> T:
    """The first truthy value of ``condition()``, polled from 5 ms up to every 0.2 s; fails the
    test with ``what`` if none comes within ``timeout`` seconds."""
    polling = Retrying(retry=retry_if_result(lambda value: not value), stop=stop_after_delay(timeout),
                       wait=wait_exponential(multiplier=0.005, max=0.2))
    try:
        return polling(condition)
    except RetryError:
        raise AssertionError(f"waited {timeout} s for {what}, in vain") from None
