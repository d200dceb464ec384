"""The test broker server itself: a restart is told by its own run's lines, not an earlier run's."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess


def test_a_restart_reads_only_its_own_runs_started_line(tmp_path: Path, unique: str) -> None:
    """The log is appended to: a restart on the same port found the first run's "started" line and
    returned before its own server listened, here one that never could (its port held)."""
    server = ServerProcess(tmp_path / "data").start()
    port = server.port
    assert server.stop() == 0
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(RuntimeError, match="exited"):  # started, before (the first run's line)
            server.start()
    assert not server.running
    server.start()  # the port free again: its own line, on the same port
    try:
        assert server.port == port and server.log.read_text().count(f"native_port={port}") == 2
        client = Client(f"127.0.0.1:{port}")
        try:
            assert [placed.offset for placed in client.publish(unique, [OutgoingMessage(b"{}")])] == [0]
        finally:
            client.close()
    finally:
        server.stop()
