"""A 3-node NATS JetStream cluster on loopback, started by the test: the machine's ``nats-server``.

Each node has its own client, cluster-route and monitoring ports (free ports,
far from the shared server's 4222) and its own store directory under the
test's tmp dir. `kill` is ``kill -9``; `start` brings a node back on the same
ports and store, as an operator's supervisor would. `leader` asks JetStream
which node leads a stream or a consumer, so a test kills the node that
really leads.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

import nats

from tests.cluster.ports import free_ports, wait_listening

STARTUP = 60.0


class NatsCluster:
    """Three ``nats-server`` processes forming one JetStream cluster."""

    def __init__(self, root: Path, name: str, size: int = 3) -> None:
        binary = shutil.which("nats-server")
        assert binary is not None, "nats-server is not installed (apt-get install nats-server)"
        self.binary, self.root, self.name = binary, root, name
        ports = free_ports(size * 3)
        self.nodes = [f"n{i}" for i in range(1, size + 1)]
        self.client = dict(zip(self.nodes, ports[0::3], strict=True))
        self.route = dict(zip(self.nodes, ports[1::3], strict=True))
        self.monitor = dict(zip(self.nodes, ports[2::3], strict=True))
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        for node in self.nodes:
            self.start(node)
        for node in self.nodes:
            self.wait_current(node)

    @property
    def url(self) -> str:
        """``nats://`` with every node's client address."""
        return "nats://" + ",".join(f"127.0.0.1:{self.client[node]}" for node in self.nodes)

    @property
    def servers(self) -> list[str]:
        return [f"nats://127.0.0.1:{self.client[node]}" for node in self.nodes]

    def start(self, node: str) -> None:
        """Start ``node`` (again): same ports, same store directory."""
        store = self.root / node
        store.mkdir(parents=True, exist_ok=True)
        routes = ",".join(f"nats://127.0.0.1:{self.route[other]}" for other in self.nodes if other != node)
        log = (self.root / f"{node}.log").open("ab")
        self.processes[node] = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.client[node]), "-m", str(self.monitor[node]),
             "-js", "-sd", str(store), "-n", node, "--cluster_name", self.name,
             "--cluster", f"nats://127.0.0.1:{self.route[node]}", "--routes", routes],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        wait_listening(self.client[node], STARTUP)

    def kill(self, node: str) -> None:
        """``kill -9`` of ``node``."""
        process = self.processes[node]
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL

    def wait_current(self, node: str) -> None:
        """Wait until ``node`` reports JetStream healthy: in the cluster and caught up."""
        deadline = time.monotonic() + STARTUP
        while not self._healthy(node):
            assert self.processes[node].poll() is None, f"nats-server {node} exited; see {self.root}/{node}.log"
            assert time.monotonic() < deadline, f"nats-server {node} never became healthy"
            time.sleep(0.2)

    def leader(self, stream: str, consumer: str | None = None) -> str:
        """The node leading ``stream`` (or its ``consumer``) now, waiting out an election."""
        deadline = time.monotonic() + STARTUP
        while True:
            found = asyncio.run(self._leader(stream, consumer))
            if found:
                return found
            assert time.monotonic() < deadline, f"no leader of {stream}/{consumer} after {STARTUP:.0f} s"
            time.sleep(0.2)

    def replicas(self, stream: str) -> int:
        """How many replicas JetStream keeps of ``stream``."""
        return asyncio.run(self._replicas(stream))

    def describe(self, stream: str, consumer: str) -> str:
        """The consumer's state as JetStream reports it (for a failing test's message)."""
        return asyncio.run(self._describe(stream, consumer))

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=30)

    def _healthy(self, node: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor[node]}/healthz", timeout=2) as reply:
                return bool(json.load(reply).get("status") == "ok")
        except OSError:
            return False

    async def _leader(self, stream: str, consumer: str | None) -> str | None:
        client = await nats.connect(self.servers, connect_timeout=2, max_reconnect_attempts=1)
        try:
            js = client.jetstream(timeout=2)
            info = await (js.consumer_info(stream, consumer) if consumer else js.stream_info(stream))
            return info.cluster.leader if info.cluster else None
        except Exception:  # an election in progress: no answer yet
            return None
        finally:
            await client.close()

    async def _describe(self, stream: str, consumer: str) -> str:
        client = await nats.connect(self.servers, connect_timeout=2)
        try:
            info = await client.jetstream(timeout=5).consumer_info(stream, consumer)
            return (f"consumer {consumer}: pending {info.num_pending}, ack pending {info.num_ack_pending}, "
                    f"redelivered {info.num_redelivered}, waiting pulls {info.num_waiting}, delivered "
                    f"{info.delivered}, ack floor {info.ack_floor}, leader {info.cluster and info.cluster.leader}")
        except Exception as exc:  # the cluster itself may be what is wrong
            return f"consumer {consumer}: no info ({type(exc).__name__}: {exc})"
        finally:
            await client.close()

    async def _replicas(self, stream: str) -> int:
        client = await nats.connect(self.servers, connect_timeout=2)
        try:
            info = await client.jetstream(timeout=5).stream_info(stream)
            return int(info.config.num_replicas or 1)
        finally:
            await client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
