"""A topic or group name the store refuses changes nothing on disk.

``topics.json`` once took any name a publish named (``..``, NUL, spaces,
``*``) before the store refused its records, so a refused publish still left
a topic behind, on disk and in every listing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.delivery.values import OutgoingMessage
from broker.errors import BrokerError
from tests.broker.delivery.conftest import Open

REFUSED = ["..", ".", "a\0b", "two words", "star*", "tab\there", "é", "x" * 201]


def _state(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.json"))}


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_topic_name_changes_nothing_on_disk(open_broker: Open, tmp_path, name) -> None:
    broker = open_broker()
    broker.publish("kept", [OutgoingMessage(b"x")])
    before = _state(tmp_path / "broker")
    with pytest.raises(BrokerError, match="topic"):
        broker.publish(name, [OutgoingMessage(b"y")])
    assert _state(tmp_path / "broker") == before
    assert set(broker.publishing.known()) == {"kept"}


@pytest.mark.parametrize("name", ["two words", "star*", "a\0b"])
def test_a_refused_group_name_changes_nothing_on_disk(open_broker: Open, tmp_path, name) -> None:
    broker = open_broker()
    broker.publish("kept", [OutgoingMessage(b"x")])
    before = _state(tmp_path / "broker")
    with pytest.raises(BrokerError, match="group"):
        broker.publish_to_group(name, "kept", [OutgoingMessage(b"y")])
    with pytest.raises(BrokerError, match="group"):
        broker.join(name, ["kept"])
    assert _state(tmp_path / "broker") == before
    assert set(broker.publishing.known()) == {"kept"}
