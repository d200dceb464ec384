"""A broker server in a process of its own, for tests: started, its port read, stopped or killed.

The process is ``python -m broker serve``'s `main`, forked from the fork server of `tests.forked`
(which has imported the server already): a test that kills and restarts the server fifty times
pays fifty forks, not fifty interpreter starts and imports (0.3 CPU-seconds each).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

from tests import forked

ROOT = Path(__file__).resolve().parents[3]
STARTED = re.compile(r"native_port=(\d+)")
STOMP = re.compile(r"stomp_port=(\d+)")
METRICS = re.compile(r"metrics_port=(\d+)")
_RUNNING: list[BaseProcess] = []  # killed when the test run ends (a failed test's too)


@atexit.register
def _kill_leftovers() -> None:
    for process in _RUNNING:
        if process.is_alive():
            process.kill()


def _serve(arguments: list[str]) -> None:
    from broker.server.run import main

    main(arguments)


class ServerProcess:
    """``python -m broker serve`` on a free port over ``data_dir``; ``url`` once it listens."""

    def __init__(self, data_dir: Path, *extra: str, port: int = 0) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.port = port
        self.stomp_port = 0
        self.metrics_port = 0
        self.process: BaseProcess | None = None
        self.log = data_dir.parent / f"{data_dir.name}-server.log"

    @property
    def url(self) -> str:
        return f"reliable://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        arguments = ["serve", "--data-dir", str(self.data_dir), "--port", str(self.port), "--stomp-port", "0",
                     *self.extra]
        self.log.touch()  # read below before the forked server has opened it
        begun = self.log.stat().st_size  # a restart appends: the earlier runs' lines are not this one's
        self.process = forked.start(_serve, [arguments], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                                    output=self.log)
        _RUNNING[:] = [*(p for p in _RUNNING if p.is_alive()), self.process]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            written = self.run_log(begun)
            found = STARTED.findall(written)
            if found and self.running and (self.port == 0 or int(found[-1]) == self.port):
                self.port = int(found[-1])
                stomp = STOMP.findall(written)
                self.stomp_port = int(stomp[-1]) if stomp else 0
                metrics = METRICS.findall(written)
                self.metrics_port = int(metrics[-1]) if metrics else 0
                return self
            if not self.running:
                raise RuntimeError(f"the broker server exited:\n{self.run_log(begun)[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"the broker server did not start:\n{self.run_log(begun)[-3000:]}")

    def run_log(self, begun: int) -> str:
        """What the log holds from byte ``begun`` on: one run's lines, where it began at ``begun``."""
        return self.log.read_bytes()[begun:].decode(errors="replace")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()  # SIGKILL
        self.process.join()

    def stop(self) -> int:
        assert self.process is not None
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGTERM)  # type: ignore[arg-type]
        self.process.join(timeout=30)
        assert self.process.exitcode is not None, "the broker server did not stop 30 s after SIGTERM"
        return self.process.exitcode
