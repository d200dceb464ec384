"""librdkafka's mock Kafka cluster in a process of its own, for tests without a Kafka server.

``python -m backends.transport.kafka_mock --brokers 3`` starts an in-process
mock cluster (librdkafka's ``rd_kafka_mock_cluster_new``) speaking the Kafka
protocol on loopback, prints its ``kafka://host:port,...`` URL on one line and
serves until its standard input closes or it is terminated. The cluster lives
as long as that process, so consumers in other processes can be killed and
come back. `MockCluster` runs it from Python.

The mock cluster's failure controls, which confluent-kafka's Python binding
does not expose, are called through ctypes on the librdkafka the binding
ships: a line ``down 2`` on standard input takes broker 2 down (its
connections closed, new ones refused), ``up 2`` brings it back, ``leader
TOPIC PARTITION 3`` makes broker 3 the partition's leader (an election, as
the controller would hold one), ``coordinator GROUP 1`` makes broker 1 the
group's coordinator, ``delete-records TOPIC PARTITION OFFSET`` deletes the
records below the offset (as retention does), ``delete-topic TOPIC`` and
``create-topic TOPIC PARTITIONS`` delete and create a topic. Each command is
answered by a line ``ok`` (or ``refused`` and the error's name).

A new group's first join is answered at once (``--initial-rebalance-delay``,
default 0 ms, as development setups of Kafka configure
``group.initial.rebalance.delay.ms``): the mock's own default holds every new
group's first member for 3 s, waiting for others that a test starts when it
means to. A later rebalance still waits the members' session timeout less one
second for them to join again, as the mock does.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Self

from backends.errors import ConfigurationError

STARTUP_TIMEOUT = 30.0
CONTROLLER = 1
"""The broker that answers as the cluster's controller (creates topics)."""


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka confluent-kafka loads (its wheel bundles one), else the system's."""
    import confluent_kafka

    bundled = sorted((Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs").glob("librdkafka*.so*"))
    name = str(bundled[0]) if bundled else ctypes.util.find_library("rdkafka")
    if name is None:
        raise ConfigurationError("librdkafka not found: install confluent-kafka (or librdkafka1)")
    lib = ctypes.CDLL(name)
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_size_t]
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    for control in ("rd_kafka_mock_broker_set_down", "rd_kafka_mock_broker_set_up"):
        getattr(lib, control).argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.rd_kafka_mock_coordinator_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32]
    lib.rd_kafka_mock_set_controller_id.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.rd_kafka_mock_partition_set_leader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                                       ctypes.c_int32]
    lib.rd_kafka_mock_partition_delete_records.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                                           ctypes.c_int64]
    lib.rd_kafka_mock_topic_delete.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_err2name.restype = ctypes.c_char_p
    return lib


def serve(brokers: int, initial_rebalance_delay_ms: int = 0) -> None:
    """Start a mock cluster, print its URL, obey failure commands until stdin closes."""
    lib = _librdkafka()
    error = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    lib.rd_kafka_conf_set(conf, b"log_level", b"3", error, len(error))  # no warning about its bootstraps
    owner = lib.rd_kafka_new(0, conf, error, len(error))  # 0: a producer handle
    if not owner:
        raise ConfigurationError(f"librdkafka: {error.value.decode()}")
    cluster = lib.rd_kafka_mock_cluster_new(owner, brokers)
    lib.rd_kafka_mock_set_controller_id(cluster, CONTROLLER)  # else topics cannot be created (CreateTopics)
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, initial_rebalance_delay_ms)
    print(f"kafka://{lib.rd_kafka_mock_cluster_bootstraps(cluster).decode()}", flush=True)
    for line in sys.stdin:  # ends at end of file: the parent is done, or gone
        command, *args = line.split()
        code = 0
        if command == "down":
            lib.rd_kafka_mock_broker_set_down(cluster, int(args[0]))
        elif command == "up":
            lib.rd_kafka_mock_broker_set_up(cluster, int(args[0]))
        elif command == "coordinator":
            lib.rd_kafka_mock_coordinator_set(cluster, b"group", args[0].encode(), int(args[1]))
        elif command == "leader":
            lib.rd_kafka_mock_partition_set_leader(cluster, args[0].encode(), int(args[1]), int(args[2]))
        elif command == "delete-records":
            code = lib.rd_kafka_mock_partition_delete_records(cluster, args[0].encode(), int(args[1]), int(args[2]))
        elif command == "delete-topic":
            code = lib.rd_kafka_mock_topic_delete(cluster, args[0].encode())
        elif command == "create-topic":
            code = lib.rd_kafka_mock_topic_create(cluster, args[0].encode(), int(args[1]), 1)
        print("ok" if code == 0 else f"refused {lib.rd_kafka_err2name(code).decode()}", flush=True)


class MockCluster:
    """A mock Kafka cluster served by a child process; ``url`` is its ``kafka://`` URL."""

    def __init__(self, brokers: int = 3, initial_rebalance_delay: float = 0.0) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "backends.transport.kafka_mock", "--brokers", str(brokers),
             "--initial-rebalance-delay", str(round(initial_rebalance_delay * 1000))],
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

    @property
    def pid(self) -> int:
        """The process serving the cluster (a test stops it with SIGSTOP: every broker hangs)."""
        return self._process.pid

    def set_down(self, broker: int) -> None:
        """Take ``broker`` down: its connections are closed and new ones refused."""
        self._command(f"down {broker}")

    def set_up(self, broker: int) -> None:
        """Bring ``broker`` back."""
        self._command(f"up {broker}")

    def set_leader(self, topic: str, partition: int, broker: int) -> None:
        """Make ``broker`` the leader of ``topic``'s ``partition`` (an election)."""
        self._command(f"leader {topic} {partition} {broker}")

    def set_coordinator(self, group: str, broker: int) -> None:
        """Make ``broker`` the coordinator of consumer group ``group``."""
        self._command(f"coordinator {group} {broker}")

    def delete_records(self, topic: str, partition: int, before: int) -> None:
        """Delete the records of ``topic``'s ``partition`` below offset ``before`` (retention)."""
        self._command(f"delete-records {topic} {partition} {before}")

    def delete_topic(self, topic: str) -> None:
        """Delete ``topic`` with its records (a member still reading it gets an unknown topic)."""
        self._command(f"delete-topic {topic}")

    def create_topic(self, topic: str, partitions: int) -> None:
        """Create ``topic`` with ``partitions`` partitions (one replica)."""
        self._command(f"create-topic {topic} {partitions}")

    def _command(self, line: str) -> None:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline().strip()
        if answer != "ok":
            raise ConfigurationError(f"the mock Kafka cluster did not obey {line!r} (answered {answer!r})")

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
    parser.add_argument("--initial-rebalance-delay", type=int, default=0, metavar="MS",
                        help="how long a new group's first join waits for more members (Kafka's "
                             "group.initial.rebalance.delay.ms; default 0)")
    arguments = parser.parse_args()
    serve(arguments.brokers, arguments.initial_rebalance_delay)


if __name__ == "__main__":
    main()
