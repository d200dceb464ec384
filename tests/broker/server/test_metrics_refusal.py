"""A connection the metrics listener refuses is logged with the metrics listener's own caps: they
are fixed (32, 4 per address), and the log line named the broker's ``max_connections`` and
``max_connections_per_address``, settings that do not change them (an operator raising them saw
the same refusals go on)."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from pathlib import Path

from structlog.testing import capture_logs

from broker.server.server import METRICS_PER_ADDRESS
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.threaded import counted
from tests.waiting import wait_until


def test_a_refused_scrape_names_the_metrics_listeners_fixed_cap_not_a_broker_setting(tmp_path: Path) -> None:
    with capture_logs() as logs, threaded.serving(tmp_path, FakeClock(), {}) as server, ExitStack() as stack:
        for _ in range(METRICS_PER_ADDRESS + 1):  # silent: each is held until its request arrives
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", server.port("metrics")))
        wait_until(lambda: counted(server.metrics.refused, listener="metrics") == 1, "the extra scrape refused")
        refusals = [line for line in logs if line["event"] == "connection_refused"]
    assert [line["listener"] for line in refusals] == ["metrics"]
    error = refusals[0]["error"]
    assert "max_connections" not in error
    assert error == (f"127.0.0.2 already holds {METRICS_PER_ADDRESS} connections, its fixed cap of "
                     f"{METRICS_PER_ADDRESS} connections from one address (no setting changes it); "
                     "close some, or scrape over fewer connections")
