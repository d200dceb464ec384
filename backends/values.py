"""The check every "a positive number" option shares, written once.

Handler options, transport and cache options, subscribe options: each
refuses zero, a negative number, a bool or a non-number the same way, naming
the option, the value and what is allowed, in the error of its own layer.
"""

from __future__ import annotations

from typing import TypeVar

from backends.errors import ConfigurationError

N = TypeVar("N", int, float)


def positive(label: str, value: N, error: type[Exception] = ConfigurationError, *,
             original: object = None, integer: bool = False) -> N:
    """``value`` if it is a positive number (an integer with ``integer``), else ``error``.

    The message names ``label`` and the value as given (``original``, where
    ``value`` was parsed from text).
    """
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        shown = value if original is None else original
        expected = "a positive integer" if integer else "a positive number"
        raise error(f"{label}={shown!r} is not allowed; expected {expected}")
    return value
