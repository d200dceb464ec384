"""Ctrl-C and SIGTERM for a running worker: the first finishes the messages in hand, a second
Ctrl-C forces the exit at once (Celery's cold shutdown): the messages in hand are not acked, and
the transport delivers them again."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial

import structlog

log = structlog.get_logger("reliable.app")

SHUTDOWN_LOG_WAIT = 5.0
"""Seconds a stopping worker waits for its shutdown line to be logged before it returns."""


def install_signals(stopping: threading.Event, in_hand: Callable[[], int]) -> Callable[[], None]:
    """Handle SIGINT / SIGTERM by setting ``stopping`` (a second SIGINT exits); return what gives
    the previous handlers back. Off the main thread nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(number: int, _frame: object) -> None:
        # The handler runs between two bytecodes of the main thread, which may be inside a log
        # call holding the logger's lock: logging here could wait on that lock forever (a second
        # Ctrl-C hung so). The handler only decides; a thread of its own logs (and exits).
        held = in_hand()
        if not stopping.is_set():
            stopping.set()
            react: Callable[[], None] = partial(_shutdown_started, number, held)
        elif number == signal.SIGINT:
            react = partial(_shutdown_forced, number, held)
        else:
            return
        reactions.append(threading.Thread(target=react, name="reliable-shutdown", daemon=True))
        reactions[-1].start()

    reactions: list[threading.Thread] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, on_signal)

    def restore() -> None:
        for reaction in reactions:  # a stop may end before its line is logged: wait for it
            reaction.join(SHUTDOWN_LOG_WAIT)
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore


def _shutdown_started(number: int, in_hand: int) -> None:
    log.warning("shutdown_started", signal=signal.Signals(number).name, in_hand=in_hand,
                then="finishing the messages in hand; Ctrl-C again forces the exit")


def _shutdown_forced(number: int, in_hand: int) -> None:
    """A second Ctrl-C: log what is handed back, then end the process at once (nothing is acked)."""
    log.error("shutdown_forced", signal=signal.Signals(number).name, handed_back=in_hand,
              then="not acknowledged: the transport delivers them again")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + number)
