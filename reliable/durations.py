"""Durations: a number of seconds, or a number with a unit (``'500ms'``, ``'5m'``, ``'2h'``).

Redelivery policies, delay levels and the settings file all read durations
this one way, so a value means the same wherever it is written.
"""

from __future__ import annotations

import math
import re

from backends.errors import ConfigurationError

DURATION_HELP = "seconds as a number, or a number followed by ms, s, m, h or d (e.g. '30s', '5m', '2h')"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | float) -> float:
    """Seconds in ``value``: a number of seconds, or a string such as ``'500ms'``, ``'5m'``, ``'2h'``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(value) if isinstance(value, str) else None
        if match is None:
            raise ConfigurationError(f"{value!r} is not a duration; expected {DURATION_HELP}")
        seconds = float(match[1]) * _UNIT_SECONDS[match[2] or "s"]
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigurationError(f"{value!r} is not a duration; expected a finite number of seconds >= 0")
    return seconds
