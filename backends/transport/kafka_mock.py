"""librdkafka's mock Kafka cluster in a process of its own, for tests without a Kafka server.

``python -m backends.transport.kafka_mock --brokers 3`` starts an in-process
mock cluster (``test.mock.num.brokers``) speaking the Kafka protocol on
loopback, prints its ``kafka://host:port,...`` URL on one line and serves until
its standard input closes or it is terminated. The cluster lives as long as
that process, so consumers in other processes can be killed and come back.
`MockCluster` runs it from Python.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Self

from backends.errors import ConfigurationError

STARTUP_TIMEOUT = 30.0


def serve(brokers: int) -> None:
    """Start a mock cluster, print its URL, and keep it up until stdin closes."""
    from confluent_kafka import Producer

    owner = Producer({"test.mock.num.brokers": brokers, "log_level": 3})
    metadata = owner.list_topics(timeout=STARTUP_TIMEOUT)
    servers = ",".join(f"{b.host}:{b.port}" for b in sorted(metadata.brokers.values(), key=lambda b: b.id))
    print(f"kafka://{servers}", flush=True)
    sys.stdin.read()  # returns at end of file: the parent is done, or gone


class MockCluster:
    """A mock Kafka cluster served by a child process; ``url`` is its ``kafka://`` URL."""

    def __init__(self, brokers: int = 3) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "backends.transport.kafka_mock", "--brokers", str(brokers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],  # this checkout's `backends`, not another's
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line.startswith("kafka://"):
            self.stop()
            raise ConfigurationError(f"the mock Kafka cluster did not start (printed {line!r})")
        self.url = line

    def kill(self) -> None:
        """SIGKILL the cluster's process: every broker disappears at once."""
        self._process.kill()
        self._process.wait()

    def stop(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", type=int, default=3, help="brokers in the mock cluster")
    serve(parser.parse_args().brokers)


if __name__ == "__main__":
    main()
