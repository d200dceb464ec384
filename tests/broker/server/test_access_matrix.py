"""The authorisation matrix, generated from the operation table, against a real server process.

Every operation of `broker.protocol.operations.OPERATIONS` is sent over the
native protocol by six callers: no credentials, a user without rights, a
user with rights on another group (but on the topic), one with rights on
another topic (but on the group), one with the right rights, and an admin.
What each caller must get is derived here from the resources the
operation's request names (a topic, a group, a member of this connection,
none: open to anyone signed in), not from its declared `Access` nor the
server's check, so a wrong declaration or a missing check shows. Listings are open to anyone
signed in and are checked for what they show. The STOMP frames that map
onto operations (SEND, SUBSCRIBE /queue/, SUBSCRIBE /topic/) run the same
matrix through stomp.py.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import stomp
from stomp.exception import ConnectFailedException

from broker.delivery.values import OutgoingMessage
from broker.protocol import codec
from broker.protocol.access import Access
from broker.protocol.operations import OPERATIONS, Field, Operation
from broker.protocol.tables import outgoing_table
from tests.broker.server.serving import ServerProcess
from tests.passwords import hash_password

TAG = uuid.uuid4().hex[:10]
TOPIC, GROUP, QUEUE = f"acl-t-{TAG}", f"acl-g-{TAG}", f"acl-q-{TAG}"
DLQ = f"%DLQ%{GROUP}"
PASSWORD = "pw"


@dataclass(frozen=True)
class Caller:
    """One column of the matrix: the rights it holds, in the terms of `Access`."""

    name: str
    signed_in: bool = True
    on_topic: bool = False  # produce and consume TOPIC (and QUEUE as a topic)
    on_group: bool = False  # act as GROUP (and QUEUE as a group), consume its %DLQ%
    admin: bool = False

    def settings(self) -> str:
        topics = [TOPIC, QUEUE] if self.on_topic else ["other.*"]
        consume = [*topics, DLQ] if self.on_group else topics
        groups = [GROUP, QUEUE] if self.on_group else ["other-*"]
        return (f'[broker.users.{self.name}]\npassword_hash = "{hash_password(PASSWORD)}"\n'
                f"produce = {topics!r}\nconsume = {consume!r}\ngroups = {groups!r}\n"
                f"admin = {'true' if self.admin else 'false'}\n").replace("'", '"')

    def may(self, op: Operation) -> bool:
        """Whether this caller may run ``op``, from the resources its request names (not from
        its declared `Access`, so a declaration that forgets a right fails the matrix)."""
        if not self.signed_in:
            return False
        if self.admin:
            return True
        names = {f.name for f in op.fields}
        if "member" in names:  # a member of its own: it must have been allowed to join
            return self.on_topic and self.on_group
        topic_ok = self.on_topic or not names & {"topic", "topics"}
        group_ok = self.on_group or "group" not in names
        return topic_ok and group_ok


CALLERS = [
    Caller("anonymous", signed_in=False),
    Caller("nobody"),
    Caller("other_group", on_topic=True),
    Caller("other_topic", on_group=True),
    Caller("rightful", on_topic=True, on_group=True),
    Caller("root", admin=True),
]

#: a value for each field an operation requires (a new field needs one here)
SAMPLES: dict[str, Any] = {
    "topic": TOPIC, "group": GROUP, "topics": [TOPIC], "receipts": [], "queue": 0, "offset": 0,
    "offsets": [0], "key": "k", "message_id": f"m-{TAG}", "reason": "matrix",
    "messages": outgoing_table([OutgoingMessage(b"x")], None),
}


def request_of(op: Operation, member: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for field in op.fields:
        if field.name == "member":
            fields["member"] = member
        elif field.name == "offsets" and op.access.member:
            fields["offsets"] = [[TOPIC, 0, 0]]
        elif field.name in SAMPLES:
            fields[field.name] = SAMPLES[field.name]
        else:
            assert _optional(field), f"{op.name}: field {field.name!r} needs a sample in SAMPLES"
    return fields


def _optional(field: Field) -> bool:
    from broker.protocol.operations import REQUIRED
    return field.default is not REQUIRED


class Wire:
    """One native connection, requests sent and replies read by hand (no client in between)."""

    def __init__(self, server: ServerProcess, caller: Caller) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        self.decoder = codec.FrameDecoder(1 << 24)
        self.ids = iter(range(1, 1 << 30))
        if caller.signed_in:
            assert self.call("hello", user=caller.name, password=PASSWORD)["ok"]

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        request_id = next(self.ids)
        self.sock.sendall(codec.encode({"id": request_id, "op": op, **fields}))
        while True:
            data = self.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            for payload in self.decoder.feed(data):
                reply = codec.decode_body(payload)
                if reply["id"] == request_id:
                    return reply

    def close(self) -> None:
        self.sock.close()


def denied(reply: dict[str, Any]) -> bool:
    """Whether the reply refuses the caller (not merely the request's content)."""
    error = reply.get("error") or {}
    return not reply["ok"] and (error.get("code") in ("permission_denied", "unauthenticated")
                                or error.get("type") == "UnknownMemberError")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("access")
    settings = folder / "reliable.toml"
    settings.write_text("[broker]\n" + "".join(c.settings() for c in CALLERS if c.signed_in))
    started = ServerProcess(folder / "data", "--settings", str(settings)).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def stranger(server: ServerProcess) -> Iterator[str]:
    """A member of GROUP joined by the admin on a connection of its own, and TOPIC with a message."""
    admin = Wire(server, CALLERS[-1])
    assert admin.call("publish", topic=TOPIC, messages=outgoing_table(
        [OutgoingMessage(b"seen", message_id=f"m-{TAG}")], [f"m-{TAG}"]))["ok"]
    joined = admin.call("subscribe", group=GROUP, topics=[TOPIC])
    yield joined["member"]
    admin.close()


def test_every_operation_declares_its_access() -> None:
    with pytest.raises(TypeError, match="declares no access"):
        Operation("launch", (), None, Access())
    assert all(op.access.declared for op in OPERATIONS.values())


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.name)
@pytest.mark.parametrize("op", list(OPERATIONS.values()), ids=lambda op: op.name)
def test_native_matrix(server, stranger, op: Operation, caller: Caller) -> None:
    wire = Wire(server, caller)
    member = stranger  # someone else's member: only a member joined here may be used
    if op.access.member and caller.may(OPERATIONS["subscribe"]):
        member = wire.call("subscribe", group=GROUP, topics=[TOPIC])["member"]
    reply = wire.call(op.name, **request_of(op, member))
    wire.close()
    if not caller.may(op):
        assert denied(reply), f"{op.name} by {caller.name}: {reply}"
        return
    assert not denied(reply), f"{op.name} by {caller.name}: {reply}"
    if op.name in SHOWN:
        SHOWN[op.name](reply, caller)


def _topics(reply: dict[str, Any], caller: Caller) -> None:
    names = {t["name"] for t in reply["topics"]}
    assert (TOPIC in names) == (caller.on_topic or caller.admin), names


def _groups(reply: dict[str, Any], caller: Caller) -> None:
    names = {g["name"] for g in reply["groups"]}
    assert (GROUP in names) == (caller.on_group or caller.admin), names


def _lag(reply: dict[str, Any], caller: Caller) -> None:
    topics = {row["topic"] for row in reply["lag"]}
    assert (TOPIC in topics) == (caller.on_topic or caller.admin), topics


def _stats(reply: dict[str, Any], caller: Caller) -> None:
    stats = reply["stats"]
    assert (stats["topics"] >= 1) == (caller.on_topic or caller.admin), stats
    assert ("messages_published" in stats) == caller.admin, stats  # the server's counters: admin only


def _lookup_id(reply: dict[str, Any], caller: Caller) -> None:
    assert (reply["messages"]["count"] == 1) == (caller.on_topic or caller.admin), reply


SHOWN = {"topics": _topics, "groups": _groups, "lag": _lag, "stats": _stats, "lookup_id": _lookup_id}


class _Outcome(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None

    def on_receipt(self, frame: Any) -> None:
        self.done.set()

    def on_error(self, frame: Any) -> None:
        self.error = frame.headers.get("message", "")
        self.done.set()


#: STOMP frames and the operation whose access they carry
STOMP_FRAMES = {"send": "publish", "subscribe_queue": "subscribe", "subscribe_topic": "read"}


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.name)
@pytest.mark.parametrize("frame", list(STOMP_FRAMES))
def test_stomp_matrix(server, frame: str, caller: Caller) -> None:
    connection = stomp.Connection12([("127.0.0.1", server.stomp_port)])
    outcome = _Outcome()
    connection.set_listener("outcome", outcome)
    if not caller.signed_in:
        with pytest.raises(ConnectFailedException):
            connection.connect(wait=True)
        return
    connection.connect(caller.name, PASSWORD, wait=True)
    if frame == "send":
        connection.send(f"/queue/{QUEUE}", "x", receipt="r")
    else:
        kind = "queue" if frame == "subscribe_queue" else "topic"
        connection.subscribe(f"/{kind}/{QUEUE}", id="1", receipt="r")
    assert outcome.done.wait(30), f"{frame} by {caller.name}: no RECEIPT or ERROR"
    if caller.may(OPERATIONS[STOMP_FRAMES[frame]]):
        assert outcome.error is None, f"{frame} by {caller.name}: {outcome.error}"
        connection.disconnect()
    else:
        assert outcome.error is not None and "permission_denied" in outcome.error, outcome.error
