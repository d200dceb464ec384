"""A RabbitMQ cluster (3 nodes, or 1) on loopback, started by the test: the machine's ``rabbitmq-server``.

Each node has its own name (``<name>a@localhost``...), AMQP and distribution
ports (free ports; the shared server on 5672 is never touched), mnesia and
log directories under the test's tmp dir, no plugins, and an Erlang cookie
of its own (``HOME`` is the cluster's directory). Nodes b and c join a with
``rabbitmqctl join_cluster``. `kill` is ``kill -9`` of a node's Erlang VM;
`start` brings it back on the same directories, where it rejoins by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.cluster.ports import free_ports, wait_closed, wait_listening

BIN = Path("/usr/lib/rabbitmq/bin")
STARTUP = 180.0


class RabbitCluster:
    """``size`` ``rabbitmq-server`` nodes clustered together (three unless told)."""

    def __init__(self, root: Path, name: str, size: int = 3) -> None:
        assert (BIN / "rabbitmq-server").exists(), "rabbitmq-server is not installed (apt-get install rabbitmq-server)"
        self.root, self.name = root, name
        root.mkdir(parents=True, exist_ok=True)
        cookie = root / ".erlang.cookie"
        cookie.write_text(f"cookie{name}")
        cookie.chmod(0o400)
        (root / "enabled_plugins").write_text("[].")
        self.nodes = [f"{name}{letter}@localhost" for letter in "abc"[:size]]
        ports = free_ports(2 * size)
        self.amqp = dict(zip(self.nodes, ports[0::2], strict=True))
        self.dist = dict(zip(self.nodes, ports[1::2], strict=True))
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        for node in self.nodes:
            self.start(node, wait=False)
        for node in self.nodes:
            wait_listening(self.amqp[node], STARTUP)
        for node in self.nodes[1:]:
            for command in (["stop_app"], ["join_cluster", self.nodes[0]], ["start_app"]):
                self.ctl(node, *command)

    def url(self, node: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp[node]}/"

    def servers(self, node: str) -> list[str]:
        """``host:port`` of every node but ``node``."""
        return [f"127.0.0.1:{self.amqp[other]}" for other in self.nodes if other != node]

    def start(self, node: str, wait: bool = True) -> None:
        """Start ``node`` (again) on its ports and directories."""
        base = self.root / node.partition("@")[0]
        base.mkdir(exist_ok=True)
        (base / "rabbitmq.conf").write_text(f"listeners.tcp.default = {self.amqp[node]}\nloopback_users = none\n")
        env = {**self._env(), "RABBITMQ_NODENAME": node, "RABBITMQ_NODE_PORT": str(self.amqp[node]),
               "RABBITMQ_DIST_PORT": str(self.dist[node]), "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
               "RABBITMQ_LOG_BASE": str(base / "log"), "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq"),
               "RABBITMQ_PID_FILE": str(base / "pid"), "RABBITMQ_PLUGINS_EXPAND_DIR": str(base / "plugins"),
               "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
               "RABBITMQ_CONF_ENV_FILE": str(base / "env"), "RABBITMQ_FEATURE_FLAGS_FILE": str(base / "ff"),
               # three VMs on two shared cores: schedulers that sleep when idle instead of spinning
               "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none"}
        with (base / "out.log").open("ab") as out:
            self.processes[node] = subprocess.Popen([str(BIN / "rabbitmq-server")], env=env, stdout=out,
                                                    stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            wait_listening(self.amqp[node], STARTUP)
            self.ctl(node, "await_startup")

    def kill(self, node: str) -> None:
        """``kill -9`` of ``node``'s Erlang VM (and the script that started it)."""
        process = self.processes[node]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        # else a restart could find the dying VM's listener still open and ask a node not yet started
        wait_closed(self.amqp[node], 30)

    def leader(self, queue: str) -> str:
        """The node leading quorum queue ``queue`` now, asked of any running node."""
        deadline = time.monotonic() + STARTUP
        while True:
            for node in self.nodes:
                if self.processes[node].poll() is not None:
                    continue
                found = self.ctl(node, "list_queues", "name", "leader", "--formatter", "json", check=False)
                try:
                    rows = json.loads(found[found.index("["):])
                except ValueError:
                    continue
                leader = next((row["leader"] for row in rows if row["name"] == queue), "")
                if leader:
                    return str(leader)
            assert time.monotonic() < deadline, f"no leader of {queue} after {STARTUP:.0f} s"
            time.sleep(0.5)

    def ctl(self, node: str, *args: str, check: bool = True) -> str:
        """``rabbitmqctl -n node args``; its output."""
        done = subprocess.run([str(BIN / "rabbitmqctl"), "-n", node, *args], env=self._env(), capture_output=True,
                              text=True, timeout=STARTUP)
        assert done.returncode == 0 or not check, f"rabbitmqctl {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def stop(self) -> None:
        for node in self.nodes:
            if self.processes[node].poll() is None:
                self.kill(node)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "HOME": str(self.root), "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins")}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
