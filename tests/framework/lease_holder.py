"""A lease-mode worker process that takes a lease and never finishes (for the kill -9 test).

    python -m tests.framework.lease_holder GROUP TOKEN MARKER LEASE

Publishes one message with token TOKEN to its own in-memory transport, and
its handler writes its pid to MARKER, then waits to be killed (60 s at most).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from backends.clock import SystemClock
from reliable import App


def main(group: str, token: str, marker: str, lease: float) -> None:
    app = App(clock=SystemClock())  # store from RELIABLE_* environment variables

    @app.handler("mail", group=group, token="body.id", lease=lease)
    def send(msg) -> None:
        Path(marker).write_text(str(os.getpid()))
        threading.Event().wait(60)  # the slow outside call, killed with kill -9 mid-way

    app.publish("mail", {"id": token})
    app.run(until_idle=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
