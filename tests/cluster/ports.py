"""Free loopback ports for the servers a cluster test starts (never the shared services' ports)."""

from __future__ import annotations

import socket
from contextlib import ExitStack

from tests.waiting import wait_until


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports nothing listens on right now (held together while chosen)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def accepts(port: int) -> bool:
    """Whether something accepts connections on loopback ``port`` now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def wait_listening(port: int, timeout: float) -> None:
    """Return once something accepts connections on ``port``; an `AssertionError` after ``timeout``."""
    wait_until(lambda: accepts(port), f"a listener on port {port}", timeout)


def wait_closed(port: int, timeout: float) -> None:
    """Return once nothing accepts connections on ``port`` (a killed server's socket closes only once its
    process is torn down, after its parent has seen it die); an `AssertionError` after ``timeout``."""
    wait_until(lambda: not accepts(port), f"port {port} to refuse connections", timeout)
