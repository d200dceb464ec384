"""Kafka keys and header values that are not UTF-8 (a Java `LongSerializer`'s key, an Avro
key, a binary header), end to end.

Another program's record keys and header values are bytes. `Message.key` and
`Message.headers` hold them as text with the bytes that are not UTF-8 kept
(`backends.types.text_from_bytes`), so two such keys stay distinct and every
copy the framework sends (a retry, a dead-letter replay) carries exactly the
bytes that came. The store records text: such a key as a token is poison,
named as such, not a duplicate of another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from backends.transport.kafka_mock import MockCluster
from backends.types import text_bytes
from reliable import App, Message, Settings
from tests.transports.kafka_place import SESSION_TIMEOUT
from tests.waiting import wait_until

# distinct bytes that are not UTF-8; read with U+FFFD replacement, the first three were one key
KEYS = [b"\x80", b"\x81", b"\xff\xfe", b"\x00\x00\x00\x00\x00\x00\x00\x80"]
SCHEMA = b"\x00\x00\x00\x01\xa7"  # a binary header value (a schema id, say)


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=1) as started:
        yield started


class Poison(Exception):
    pass


def app_on(cluster: MockCluster, tmp_path: Path) -> App:
    return App(Settings.load(None, env={
        "RELIABLE_TRANSPORT__URL": cluster.url,
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(SESSION_TIMEOUT),  # the second app joins after the first
        "RELIABLE_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}",
        "RELIABLE_CACHE__URL": "memory://",
        "RELIABLE_RETRY__INITIAL_DELAY": "0.05",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    }))


def run_until(app: App, done: Callable[[], bool]) -> None:
    """Run ``app``'s worker until ``done()`` (Kafka cannot tell a group's backlog: no ``until_idle``)."""
    runner = threading.Thread(target=app.run)
    runner.start()
    try:
        wait_until(done, "the worker to be done")
    finally:
        app.stop()
        runner.join()


def produce_foreign(cluster: MockCluster, topic: str) -> None:
    """Records as a program that is not `reliable` writes them: binary keys, no `x-reliable-*` headers."""
    producer = Producer({"bootstrap.servers": cluster.url.removeprefix("kafka://")})
    for n, key in enumerate(KEYS):
        producer.produce(topic, value=f'{{"n": {n}}}'.encode(), key=key, headers=[("schema", SCHEMA)])
    assert producer.flush(10) == 0


def test_binary_keys_are_kept_through_retry_dead_letter_and_replay(
    cluster: MockCluster, tmp_path: Path, unique: str
) -> None:
    app = app_on(cluster, tmp_path)
    seen: list[tuple[int, int, bytes]] = []

    @app.handler(unique, group=unique, fatal=[Poison])
    def fail(message: Message) -> None:
        assert text_bytes(message.headers["schema"]) == SCHEMA, message.headers
        seen.append((message.body["n"], message.attempt, text_bytes(message.key or "")))
        if message.attempt == 1:
            raise RuntimeError("retry me")  # redelivered through the group's retry topic
        raise Poison("dead-letter me")

    produce_foreign(cluster, unique)
    run_until(app, lambda: app.dead_letter_queue.count(unique) == len(KEYS))
    letters = app.dead_letter_queue.page(unique)
    assert sorted(text_bytes(letter.message.key or "") for letter in letters) == sorted(KEYS)
    assert {text_bytes(letter.message.headers["schema"]) for letter in letters} == {SCHEMA}
    assert sorted(seen) == sorted((n, attempt, key) for n, key in enumerate(KEYS) for attempt in (1, 2))
    assert app.dead_letter_queue.replay(unique) == len(KEYS)
    app.close()

    fixed = app_on(cluster, tmp_path)  # the handler fixed, deployed again
    replayed: list[tuple[int, bytes]] = []

    @fixed.handler(unique, group=unique)
    def handle(message: Message) -> None:
        replayed.append((message.body["n"], text_bytes(message.key or "") + text_bytes(message.headers["schema"])))

    run_until(fixed, lambda: len(replayed) == len(KEYS))
    assert sorted(replayed) == sorted((n, key + SCHEMA) for n, key in enumerate(KEYS))
    fixed.close()


def test_a_binary_key_as_token_is_poison_not_a_duplicate(cluster: MockCluster, tmp_path: Path, unique: str) -> None:
    app = app_on(cluster, tmp_path)
    handled: list[bytes] = []

    @app.handler(unique, group=unique, token="key")
    def handle(message: Message) -> None:
        handled.append(text_bytes(message.key or ""))

    produce_foreign(cluster, unique)
    run_until(app, lambda: app.dead_letter_queue.count(unique) + len(handled) == len(KEYS))
    letters = app.dead_letter_queue.page(unique)
    assert handled == []
    assert sorted(text_bytes(letter.message.key or "") for letter in letters) == sorted(KEYS)
    assert {letter.failure.error_type for letter in letters} == {"reliable.errors.TokenInvalidError"}
    assert all(letter.failure.attempts == 1 for letter in letters)
    app.close()
