"""``embedded://DIR``: the broker in process, its directory shared by the processes of one machine.

One process owns the directory (it runs the engine and serves its local
socket); others reach it through the socket. These tests use real processes,
kill them with SIGKILL, and reopen directories.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backends.clock import FakeClock
from backends.errors import ConfigurationError
from backends.transport import open_transport
from backends.transport.base import Transport
from backends.types import Message, OutgoingMessage

ROOT = Path(__file__).resolve().parents[3]


def outgoing(count: int, prefix: str = "m") -> list[OutgoingMessage]:
    return [OutgoingMessage(f'{{"n":{n}}}'.encode(), message_id=f"{prefix}{n}") for n in range(count)]


def drain(transport: Transport, group: str, topic: str) -> list[Message]:
    received: list[Message] = []
    with transport.subscribe(group, [topic]) as member:
        while messages := member.fetch(10, 0.2):
            member.ack(messages)
            received += messages
    return received


CHILD = """
import json, sys, time
from pathlib import Path
import structlog
from broker.embedded import open_embedded

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is the report

path, topic, mode, count = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
api = open_embedded(path)
member = api.join("g", [topic])
if mode == "hold":  # fetch, report, then wait to be killed
    print(json.dumps([d.message_id for d in api.fetch(member, count, 5)]), flush=True)
    time.sleep(60)
print(json.dumps({"owner": api.owner}), flush=True)
while not (path / "go").exists():
    time.sleep(0.002)
received = []
while deliveries := api.fetch(member, count, 0.5):
    received += [d.message_id for d in deliveries]
    api.ack(member, [d.receipt for d in deliveries])
print(json.dumps(received), flush=True)
"""


def start_child(path: Path, topic: str, mode: str, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), topic, mode, str(count)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_an_owner_killed_with_messages_in_flight_loses_none(tmp_path: Path, unique: str) -> None:
    path = tmp_path / "broker"
    with open_transport(f"embedded://{path}") as transport:
        transport.publish(unique, outgoing(50))
    child = start_child(path, unique, "hold", 20)  # nobody owns the directory: the child does
    try:
        held = json.loads(child.stdout.readline())  # type: ignore[union-attr]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert len(held) == 20
    with open_transport(f"embedded://{path}") as transport:  # recovery after the kill
        received = drain(transport, "g", unique)
        assert sorted(m.id for m in received) == sorted(f"m{n}" for n in range(50))
        assert set(held) <= {m.id for m in received}
        with transport.subscribe("g", [unique]) as looker:
            assert looker.pending() == 0


def test_two_processes_share_a_group_through_the_owner_and_never_get_the_same_message(
    tmp_path: Path, unique: str
) -> None:
    path = tmp_path / "broker"
    with open_transport(f"embedded://{path}") as owner:  # this process owns the directory
        owner.publish(unique, outgoing(400))
        children = [start_child(path, unique, "drain", 10) for _ in range(2)]
        try:
            for child in children:  # both joined (and reach the owner) before either fetches
                assert json.loads(child.stdout.readline()) == {"owner": False}  # type: ignore[union-attr]
            (path / "go").touch()
            received = [json.loads(child.communicate(timeout=60)[0]) for child in children]
        finally:
            for child in children:
                child.kill()
    everything = received[0] + received[1]
    assert len(everything) == len(set(everything)) == 400
    assert all(received)  # both took part


def test_a_nacked_message_survives_reopening_with_its_delay_and_count(tmp_path: Path, unique: str) -> None:
    url = f"embedded://{tmp_path / 'broker'}"
    clock = FakeClock()
    first = open_transport(url, clock)
    first.publish(unique, outgoing(3))
    member = first.subscribe("g", [unique])
    fetched = member.fetch(1, 0)[0]
    member.nack(fetched, 5.0)
    first.close()
    second = open_transport(url, clock)
    with second.subscribe("g", [unique]) as again:
        assert again.pending() == 3
        others = again.fetch(10, 0)
        again.ack(others)
        assert sorted(m.id for m in others) == sorted({"m0", "m1", "m2"} - {fetched.id})
        assert again.next_due() == clock.time() + 5.0 and again.fetch(10, 0) == []
        clock.advance(5.0)
        (retried,) = again.fetch(10, 0)
        assert (retried.id, retried.attempt, retried.payload) == (fetched.id, 2, fetched.payload)
        again.ack([retried])
        assert again.pending() == 0
    second.close()


def test_embedded_urls_and_bad_options(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with open_transport("embedded://./.reliable/broker") as relative:
        relative.publish("t", outgoing(1))
    assert (tmp_path / ".reliable/broker/commitlog").is_dir()
    with open_transport(f"embedded://{tmp_path}/abs?queues=2") as absolute:
        absolute.publish("t", outgoing(4))
        assert {m.queue for m in drain(absolute, "g", "t")} == {0, 1}
    with pytest.raises(ConfigurationError, match="queues='x'"):
        open_transport(f"embedded://{tmp_path}/x?queues=x")
    with pytest.raises(ConfigurationError, match="flush"):
        open_transport(f"embedded://{tmp_path}/y?flush=sometimes")
    with pytest.raises(ConfigurationError, match="synchronous"):
        open_transport(f"embedded://{tmp_path}/z?synchronous=OFF")


PUBLISHER = """
import sys
from backends.transport import open_transport
from backends.types import OutgoingMessage

with open_transport(f"embedded://{sys.argv[1]}") as transport:
    transport.publish(sys.argv[2], [OutgoingMessage(b'{"n":%d}' % n, message_id=f"c{n}") for n in range(5)])
"""


def test_a_process_that_does_not_own_the_directory_publishes_through_the_owner(tmp_path: Path, unique: str) -> None:
    path = tmp_path / "broker"
    with open_transport(f"embedded://{path}") as owner:  # this process owns the directory
        owner.publish(unique, outgoing(1))
        child = subprocess.run([sys.executable, "-c", PUBLISHER, str(path), unique], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert child.returncode == 0, child.stderr[-3000:]
        assert sorted(m.id for m in drain(owner, "g", unique)) == ["c0", "c1", "c2", "c3", "c4", "m0"]
