"""Logging and counters: structlog set up once (JSON in production, console in a terminal).

Log events use the vocabulary of the design (``duplicate_skipped``,
``redelivery_scheduled``, ``dead_lettered``, ...); `Counters` keeps the same
outcomes as numbers for ``App.stats()``. Tests capture events with
``structlog.testing.capture_logs``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from typing import TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import FilteringBoundLogger, Processor

from backends.errors import ConfigurationError

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("auto", "json", "console")

_configured: tuple[object, ...] | None = None
_configure_lock = threading.Lock()


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Configure structlog for the process; calling it again with the same arguments changes nothing.

    ``fmt="auto"`` renders JSON lines unless ``stream`` (default: stderr) is a
    terminal, where it renders colourful console lines. Timestamps are ISO 8601
    UTC; events below ``level`` are dropped before any processing.
    """
    global _configured
    level_number = _level_number(level)
    if fmt not in FORMATS:
        raise ConfigurationError(f"log format {fmt!r} is not allowed; expected one of {', '.join(FORMATS)}")
    out = stream if stream is not None else sys.stderr
    key = (level_number, fmt, out)
    with _configure_lock:
        if _configured == key and structlog.is_configured():
            return
        structlog.configure(
            processors=_processors(_use_console(fmt, out)),
            wrapper_class=structlog.make_filtering_bound_logger(level_number),
            logger_factory=_NeverRaising(out),
            cache_logger_on_first_use=False,  # so capture_logs() works in users' tests
        )
        _configured = key


class _NeverRaising:
    """Loggers printing to ``stream`` that never raise into the code that logs.

    A log file on a full disk (``reliable run ... 2>> worker.log``) made every log call
    raise ENOSPC, and the first one in the worker's loop ended ``run()``. A write that
    fails is counted instead, like the standard library's ``Handler.handleError``, and
    once writing works again one ``log_write_failed`` line says how many failed.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._failed = 0
        self._lock = threading.Lock()

    def __call__(self, *args: object) -> structlog.PrintLogger:
        return _Printer(self.stream, self)

    def print(self, emit: Callable[[str], None], line: str) -> None:
        try:
            if self._failed:
                with self._lock:
                    failed, self._failed = self._failed, 0
                emit(json.dumps({"event": "log_write_failed", "failures": failed, "level": "warning",
                                 "reason": "log lines could not be written (a full disk?)"}))
            emit(line)
        except OSError:
            with self._lock:
                self._failed += 1


class _Printer(structlog.PrintLogger):
    def __init__(self, stream: TextIO, lines: _NeverRaising) -> None:
        super().__init__(stream)
        self._lines = lines

    def msg(self, message: str) -> None:
        self._lines.print(super().msg, message)

    log = debug = info = warn = warning = fatal = failure = err = error = critical = exception = msg


def get_logger(name: str) -> FilteringBoundLogger:
    """A logger whose events carry ``logger=name``."""
    logger: FilteringBoundLogger = structlog.get_logger().bind(logger=name)
    return logger


def _level_number(level: str) -> int:
    name = level.lower() if isinstance(level, str) else level
    if name not in LEVELS:
        raise ConfigurationError(f"log level {level!r} is not allowed; expected one of {', '.join(LEVELS)}")
    return int(logging.getLevelName(name.upper()))


def _use_console(fmt: str, stream: TextIO) -> bool:
    if fmt != "auto":
        return fmt == "console"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _processors(console: bool) -> list[Processor]:
    """Tracebacks keep file, line and code but no local variables: a handler's locals hold message
    bodies (customer data) and made a dead letter's log line some 10 KB."""
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if console:
        return [*shared, structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False))]
    tracebacks = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))
    return [*shared, tracebacks, structlog.processors.JSONRenderer()]


COUNTERS = (
    "processed",
    "duplicate",
    "retried",
    "redelivered",
    "dead_lettered",
    "deferred",
    "cache_degraded",
)
"""The outcomes every `Counters` reports, even when still zero."""


class Counters:
    """Thread-safe named counters; any name may be counted, the standard ones always show."""

    def __init__(self, names: tuple[str, ...] = COUNTERS) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(names, 0)

    def incr(self, name: str, n: int = 1) -> None:
        """Add ``n`` (>= 0) to counter ``name``."""
        if n < 0:
            raise ValueError(f"counters only grow; cannot add {n} to {name!r}")
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def get(self, name: str) -> int:
        """The current value of ``name`` (0 if never counted)."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter."""
        with self._lock:
            return dict(self._values)

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"
