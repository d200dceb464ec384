"""``reliable broker stats | dlq list | replay | purge | message`` against a server process and an embedded directory."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from broker.client import Client
from broker.delivery.values import OutgoingMessage
from broker.embedded import open_embedded
from reliable.cli import cli
from tests.broker.server.serving import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = ServerProcess(tmp_path_factory.mktemp("admin") / "data").start()
    yield started
    started.stop()


def broker(*args: str) -> list[dict]:  # type: ignore[type-arg]
    result = CliRunner().invoke(cli, ["broker", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def dead_letters(client: Client, topic: str, group: str, count: int) -> list[str]:
    """Publish ``count`` messages and dead-letter each; their ids."""
    client.publish(topic, [OutgoingMessage(f"bad {n}".encode(), key=f"k{n}", message_id=f"{topic}-{n}")
                           for n in range(count)])
    member = client.join(group, [topic])
    got: list[str] = []
    while len(got) < count:
        batch = client.fetch(member, count, 2.0)
        client.dead_letter(member, [d.receipt for d in batch], "cannot parse")
        got += [d.message_id for d in batch]
    client.leave(member)
    return got


def test_dlq_list_replay_and_purge_on_a_server(server, unique) -> None:
    client = Client(server.url)
    group = f"{unique}-g"
    ids = dead_letters(client, unique, group, 30)
    listed = broker("dlq", "list", group, "--url", server.url, "--limit", "100")
    assert sorted(row["message_id"] for row in listed) == sorted(ids)
    assert {row["headers"]["x-dlq-cause"] for row in listed} == {"cannot parse"}
    assert broker("dlq", "replay", group, "--url", server.url) == [{"group": group, "replayed": 30}]
    assert broker("dlq", "list", group, "--url", server.url) == []
    member = client.join(group, [unique])
    back: list[bytes] = []
    while len(back) < 30:
        batch = client.fetch(member, 30, 2.0)
        assert batch, "the replayed messages did not come back to the group"
        client.dead_letter(member, [d.receipt for d in batch], "still bad")
        back += [d.body for d in batch]
    assert sorted(back) == sorted(f"bad {n}".encode() for n in range(30))
    assert broker("dlq", "purge", group, "--yes", "--url", server.url) == [{"group": group, "purged": 30}]
    assert broker("dlq", "list", group, "--url", server.url) == []
    client.close()


def test_stats_and_message_lookup_on_a_server(server, unique) -> None:
    client = Client(server.url)
    before = time.time() - 1
    placed = client.publish(unique, [OutgoingMessage(f"order {n}".encode(), key=f"customer-{n % 3}")
                                     for n in range(9)])
    by_key = broker("message", unique, "--key", "customer-1", "--since", str(before), "--url", server.url)
    assert [row["body"] for row in by_key] == ["order 1", "order 4", "order 7"]
    assert broker("message", unique, "--key", "customer-1", "--until", str(before),
                  "--url", server.url) == []  # stored after the range
    by_id = broker("message", "--id", placed[4].message_id, "--url", server.url)
    assert [(row["topic"], row["offset"], row["body"]) for row in by_id] == [
        (unique, placed[4].offset, "order 4")]
    assert broker("message", "--id", "no-such-id", "--url", server.url) == []
    stats = broker("stats", "--url", server.url)[0]
    assert stats["messages_published"] >= 9 and stats["topics"] >= 1 and stats["connections_open"] >= 1
    client.close()


def test_the_same_commands_on_an_embedded_directory(tmp_path: Path) -> None:
    directory = tmp_path / "broker"
    api = open_embedded(directory)
    api.publish("orders", [OutgoingMessage(b'{"n": 1}', key="alice", message_id="order-1")])
    api.close()
    url = f"embedded://{directory}"
    assert [row["body"] for row in broker("message", "orders", "--key", "alice", "--url", url)] == ['{"n": 1}']
    assert [row["message_id"] for row in broker("message", "--id", "order-1", "--url", url)] == ["order-1"]
    assert broker("stats", "--url", url) == [{"groups": 0, "members": 0, "messages": 1, "topics": 1}]
    table = CliRunner().invoke(cli, ["broker", "message", "orders", "--key", "alice", "--url", url])
    assert "alice" in table.stdout and "order-1" in table.stdout


def test_message_lookup_needs_an_id_or_a_key(server) -> None:
    result = CliRunner().invoke(cli, ["broker", "message", "t", "--url", server.url])
    assert result.exit_code != 0 and "either --id" in result.output


def test_dlq_replay_and_purge_of_chosen_letters_on_a_server(server, unique) -> None:
    client = Client(server.url)
    group = f"{unique}-g"
    dead_letters(client, unique, group, 3)
    listed = broker("dlq", "list", group, "--url", server.url)
    chosen = listed[1]
    assert broker("dlq", "replay", group, "--offset", str(chosen["offset"]), "--url", server.url) == [
        {"group": group, "replayed": 1}]
    left = broker("dlq", "list", group, "--url", server.url)
    assert [row["message_id"] for row in left] == [listed[0]["message_id"], listed[2]["message_id"]]
    member = client.join(group, [unique])
    (back,) = client.fetch(member, 10, 2.0)
    assert back.body == chosen["body"].encode()
    assert broker("dlq", "purge", group, "--yes", "--offset", str(listed[0]["offset"]),
                  "--url", server.url) == [{"group": group, "purged": 1}]
    assert [row["message_id"] for row in broker("dlq", "list", group, "--url", server.url)] == [
        listed[2]["message_id"]]
    client.close()
