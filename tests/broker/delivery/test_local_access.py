"""Another OS user on the machine cannot reach an embedded broker or the SQLite store, whatever the umask.

The local socket (``DIR/broker.sock``) asks no credentials: whoever can
connect may read, ack, skip and purge every group. Under a umask of 0 (or 002
and a shared group) it was created writable by others, and the directory and
its commit log readable by them, as the SQLite store's file (tokens, dead
letters with their bodies). The owner runs here in a process of its own under
umask 0; a second process turns into ``nobody`` and tries the socket and the
files, with the owner's directories reachable through a world-searchable
parent (only the modes the project sets stand in the way).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.delivery.values import OutgoingMessage
from broker.embedded import EmbeddedBroker

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="turning into another OS user needs root")

OWNER = """
import sys
from broker.delivery.values import OutgoingMessage
from broker.embedded import EmbeddedBroker
from reliable.testing import test_app
broker = EmbeddedBroker(sys.argv[1] + "/broker")
broker.publish("secrets", [OutgoingMessage(b"a card number", message_id="m1")])
app = test_app(sys.argv[1] + "/app")  # its SQLite store in a directory of its own making
with app.store.transaction():
    pass
print("owner", flush=True)
sys.stdin.read()  # until the test closes our stdin
app.close()
broker.close()
"""

OTHER_USER = """
import os, pwd, socket, sys
nobody = pwd.getpwnam("nobody")
os.setgid(nobody.pw_gid)
os.setuid(nobody.pw_uid)
directory = sys.argv[1] + "/broker"
results = []
try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.path.join(directory, "broker.sock"))
    results.append("socket: connected")
except PermissionError:
    results.append("socket: refused")
try:
    logs = os.listdir(os.path.join(directory, "commitlog"))
    results.append(f"commit log: read {len(logs)} segment(s)")
except PermissionError:
    results.append("commit log: refused")
try:
    with open(sys.argv[1] + "/app/store.db", "rb") as store:
        results.append(f"store: read {len(store.read())} bytes")
except PermissionError:
    results.append("store: refused")
print("; ".join(results))
"""


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A fresh directory under /tmp that every user may enter (``tmp_path`` is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="reliable-local-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_another_os_user_can_neither_connect_nor_read_the_messages_nor_the_store(reachable_dir: Path) -> None:
    directory = reachable_dir / "broker"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(reachable_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.umask(0))
    try:
        assert owner.stdout is not None
        assert "owner" in (line.strip() for line in owner.stdout)  # its log lines first, then ours
        socket_mode = stat.S_IMODE((directory / "broker.sock").stat().st_mode)
        other = subprocess.run([sys.executable, "-c", OTHER_USER, str(reachable_dir)], capture_output=True,
                               text=True, timeout=60, check=True)
        assert other.stdout.strip() == "socket: refused; commit log: refused; store: refused", \
            (oct(socket_mode), other.stdout)
        assert socket_mode == 0o600
        assert stat.S_IMODE(directory.stat().st_mode) == stat.S_IMODE((reachable_dir / "app").stat().st_mode) == 0o700

        this_user = EmbeddedBroker(directory)  # the owner's own user still reaches it, through the socket
        try:
            assert not this_user.owner
            this_user.publish("secrets", [OutgoingMessage(b"another", message_id="m2")])
            assert [t.messages for t in this_user.topics() if t.name == "secrets"] == [2]
        finally:
            this_user.close()
    finally:
        assert owner.stdin is not None
        owner.stdin.close()
        assert owner.wait(timeout=60) == 0
