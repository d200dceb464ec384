"""What the tests of refused settings share: a command run to its end, `App.run` on a thread."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reliable import App
from tests import forked
from tests.waiting import wait_until

JOIN = 60.0
"""Seconds a run that should end is given (a loaded machine is slow); the old code never ended."""


def reliable_cmd(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``reliable ARGS --settings reliable.toml`` in ``project``, to its end (or `JOIN` seconds), in a
    process of its own forked from the fork server (`tests.forked`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    return forked.reliable([*args, "--settings", "reliable.toml"], project, env, timeout=JOIN)


def said(done: subprocess.CompletedProcess[str]) -> list[str]:
    """What a command wrote to stderr besides its JSON log lines."""
    return [line for line in done.stderr.splitlines() if not line.startswith("{")]


class Running:
    """``app.run(...)`` on a thread, its exception kept."""

    def __init__(self, app: App, **options: Any) -> None:
        self.app = app
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, kwargs=options, daemon=True)
        self.thread.start()

    def _run(self, **options: Any) -> None:
        try:
            self.app.run(**options)
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self.thread.join(JOIN)
        if self.thread.is_alive():
            self.app.stop()  # let the thread end before the test fails
            self.thread.join(JOIN)
            raise AssertionError(f"app.run() still running after {JOIN} s")


def run_through_outage(app: App, waiting: Callable[[], bool], what: str, end_outage: Callable[[], None]) -> None:
    """``app.run(until_idle=True)`` on a thread: once ``waiting()`` shows it waiting out an outage
    (``what``) and still running, end the outage; the run then ends by itself, without an error."""
    run = Running(app, until_idle=True)
    wait_until(waiting, what)
    assert run.thread.is_alive()
    end_outage()
    run.join()
    assert run.error is None, run.error
