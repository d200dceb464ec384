"""Headers a STOMP consumer's version cannot carry never reach its wire.

A message's headers and id come from any producer: a native client may put
any string there, a STOMP 1.1/1.2 producer a line feed (escaped as ``\\n``)
or a raw NUL. STOMP 1.0 has no escapes, and clients cut frames at the first
NUL (stomp.py does), so such a header written as it is lets a producer forge
frames on another user's connection. Each test reads with stomp.py, a real
client, and shows the frames it gets are the frames the broker meant.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import stomp

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from tests.broker.server.serving import ServerProcess
from tests.broker.server.test_stomp import Inbox, settled
from tests.passwords import hash_password

FORGED = "a\n\nFORGED\x00MESSAGE\ndestination:/queue/elsewhere\n\nforged"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("stomp-headers")
    settings = folder / "reliable.toml"
    settings.write_text(
        f'[broker.users.app]\npassword_hash = "{hash_password("s3cret")}"\n'
        'produce = ["*"]\nconsume = ["*"]\ngroups = ["*"]\n')
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


def consumer(server: ServerProcess, version: str) -> tuple[stomp.Connection, Inbox]:
    kind = {"1.0": stomp.Connection10, "1.1": stomp.Connection11, "1.2": stomp.Connection12}[version]
    connection = kind([("127.0.0.1", server.stomp_port)], auto_decode=False)
    inbox = Inbox()
    connection.set_listener("inbox", inbox)
    connection.connect("app", "s3cret", wait=True)
    return connection, inbox


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2"])
def test_a_producer_cannot_forge_frames_on_a_consumers_connection(server, unique, version) -> None:
    connection, inbox = consumer(server, version)
    ack_mode = "client" if version == "1.0" else "client-individual"
    connection.subscribe(f"/queue/{unique}", id="1", ack=ack_mode, headers={"receipt": "joined"})
    assert inbox.wait_for(1, "receipts") == ["joined"]
    producer = Client(server.url, user="app", password="s3cret")
    producer.publish(unique, [  # one key: one queue, in order
        OutgoingMessage(b"real", key=unique, message_id=f"{unique}\n\nFORGED\x00", headers={
            "x-forged": FORGED, "x-nul": "a\x00b", "x-lines": "one\ntwo", "x-plain": "kept"}),
        OutgoingMessage(b"marker", key=unique, message_id=f"{unique}-marker")])
    producer.close()

    messages = inbox.wait_for(2)
    assert [m.body for m in messages] == [b"real", b"marker"]
    assert {m.headers["destination"] for m in messages} == {f"/queue/{unique}"}
    real = messages[0].headers
    assert real["x-plain"] == "kept" and "x-nul" not in real and "x-forged" not in real
    # 1.1 and 1.2 escape a line feed; 1.0 cannot carry it
    assert real.get("x-lines") == (None if version == "1.0" else "one\ntwo")
    for message in messages:  # each is acknowledged by what its frame says (1.0/1.1: its message-id)
        if version == "1.2":
            connection.ack(message.headers["ack"])
        elif version == "1.1":
            connection.ack(message.headers["message-id"], subscription="1")
        else:
            connection.ack(message.headers["message-id"])
    settled(server, unique)
    assert not inbox.errors
    connection.disconnect()
