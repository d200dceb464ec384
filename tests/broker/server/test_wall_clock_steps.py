"""A broker server process whose wall clock really steps, by libfaketime, while its monotonic
clock runs on (``FAKETIME_DONT_FAKE_MONOTONIC=1``): the step an NTP correction or a resumed VM
makes, seen by ``time.time()`` in the server only.

The server reads its clock's offset from a file (``FAKETIME_TIMESTAMP_FILE``, read at every call
with ``FAKETIME_NO_CACHE=1``); the test writes ``-1h`` or ``+1h`` there while a member holds a
message. scripts/services.sh installs libfaketime (``faketime``) where it is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.transport import open_transport
from backends.types import OutgoingMessage
from tests.broker.server.serving import STARTED
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = next(iter([*Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"),
                     *Path("/usr/lib").glob("faketime/libfaketimeMT.so.1")]), None)


@pytest.fixture
def offset(tmp_path: Path) -> Path:
    """The file the server's libfaketime reads its wall clock's offset from."""
    if LIBRARY is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("libfaketime is missing: scripts/services.sh installs it (apt-get install faketime)")
        pytest.skip("libfaketime is missing (apt-get install faketime)")
    path = tmp_path / "faketime"
    path.write_text("+0\n")
    return path


@pytest.fixture
def server(tmp_path: Path, offset: Path) -> Iterator[str]:
    """``python -m broker serve`` under libfaketime; its URL once it listens."""
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LD_PRELOAD": str(LIBRARY),
           "FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "broker", "serve", "--data-dir", str(tmp_path / "data"),
                                    "--port", "0", "--stomp-port", "0"], cwd=ROOT, env=env,
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        found = wait_until(lambda: STARTED.findall(log.read_text()) or process.poll() is not None,
                           "the broker server to listen")
        assert process.poll() is None, log.read_text()[-3000:]
        yield f"reliable://127.0.0.1:{found[-1]}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("step", ["-1h", "+1h"], ids=["back", "forward"])
def test_a_held_message_comes_back_when_its_lease_ends_whichever_way_the_servers_clock_steps(
    server: str, offset: Path, step: str
) -> None:
    """The member holding a message falls silent (a hung consumer): the server hands it again
    once its 5 s lease ends, not an hour later (a step back) and not at once (a step forward)."""
    with open_transport(f"{server}?visibility_timeout=5") as transport:
        transport.publish("orders", [OutgoingMessage(b'{"id": 1}', message_id="o1")])
        with transport.subscribe("billing", ["orders"]) as member:
            (first,) = wait_until(lambda: member.fetch(1, 0.2), "o1 delivered")
            offset.write_text(f"{step}\n")
            assert member.fetch(1, 0.5) == []  # still leased
            (again,) = wait_until(lambda: member.fetch(1, 0.2), "o1 delivered again when its lease ended")
            member.ack([again])
    assert (first.id, first.attempt, again.id, again.attempt) == ("o1", 1, "o1", 2)


@pytest.mark.parametrize("step", ["-1h", "+1h"], ids=["back", "forward"])
def test_a_scheduled_message_and_a_delayed_retry_keep_their_delay_whichever_way_the_servers_clock_steps(
    server: str, offset: Path, step: str
) -> None:
    """A message published for 3 s later, and one nacked for a 3 s retry, come when due and not
    before, although the server's wall clock stepped an hour while they waited: parked on the
    monotonic clock once the group's cursor read them (their due times in the log are wall time)."""
    with open_transport(f"{server}?visibility_timeout=30") as transport:
        with transport.subscribe("billing", ["orders"]) as member:
            transport.publish("orders", [OutgoingMessage(b"later", message_id="later", delay=3.0),
                                         OutgoingMessage(b"now", message_id="now")])
            (now,) = wait_until(lambda: member.fetch(1, 0.2), "the message not delayed")
            member.nack(now, 3.0)  # its retry copy is due in 3 s, in wall time on disk
            assert member.fetch(1, 0.5) == []  # the group's cursors read both: parked
            offset.write_text(f"{step}\n")
            assert member.fetch(1, 0.5) == []  # a step forward delivers neither early
            came = [m.id for m in wait_until(lambda: member.fetch(2, 0.5), "both when due (3 s), not in an hour")]
            came += [m.id for m in ([] if len(came) == 2 else wait_until(lambda: member.fetch(1, 0.5), "the other"))]
            assert sorted(came) == ["later", "now"]
