"""A broker server in a process of its own, for tests: started, its port read, stopped or killed."""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STARTED = re.compile(r"native_port=(\d+)")
STOMP = re.compile(r"stomp_port=(\d+)")
METRICS = re.compile(r"metrics_port=(\d+)")
_RUNNING: list[subprocess.Popen[str]] = []  # killed when the test run ends (a failed test's too)


@atexit.register
def _kill_leftovers() -> None:
    for process in _RUNNING:
        if process.poll() is None:
            process.kill()


class ServerProcess:
    """``python -m broker serve`` on a free port over ``data_dir``; ``url`` once it listens."""

    def __init__(self, data_dir: Path, *extra: str, port: int = 0) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.port = port
        self.stomp_port = 0
        self.metrics_port = 0
        self.process: subprocess.Popen[str] | None = None
        self.log = data_dir.parent / f"{data_dir.name}-server.log"

    @property
    def url(self) -> str:
        return f"reliable://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "broker", "serve", "--data-dir", str(self.data_dir),
                 "--port", str(self.port), "--stomp-port", "0", *self.extra],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                stderr=subprocess.STDOUT, text=True)
        _RUNNING[:] = [*(p for p in _RUNNING if p.poll() is None), self.process]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = STARTED.findall(self.log.read_text())
            if found and self.process.poll() is None and (self.port == 0 or int(found[-1]) == self.port):
                self.port = int(found[-1])
                stomp = STOMP.findall(self.log.read_text())
                self.stomp_port = int(stomp[-1]) if stomp else 0
                metrics = METRICS.findall(self.log.read_text())
                self.metrics_port = int(metrics[-1]) if metrics else 0
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"the broker server exited:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"the broker server did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)
