"""The pipeline with the store cut (real PostgreSQL behind `tests.tcp_proxy`) in batch and lease mode.

Nothing is dead-lettered without its record, and a store outage after a
lease-mode side effect stays inside the pipeline: the message is not acked,
its lease expires, and the stored result stays consistent.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from reliable import Message
from reliable.testing import FakeClock, dead_letter_queue, test_app
from tests.framework.conftest import cut_once_the_store_answers
from tests.tcp_proxy import TcpProxy


class RestoringClock(FakeClock):
    """A fake clock that brings the store back the first time the worker waits."""

    def __init__(self, postgres_proxy: TcpProxy) -> None:
        super().__init__()
        self.postgres_proxy = postgres_proxy

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.postgres_proxy.restore()


def proxied_url(postgres_url: str, postgres_proxy: TcpProxy) -> str:
    parts = urlsplit(postgres_url)
    return urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{postgres_proxy.port}"))


def test_batch_mode_with_the_store_down_dead_letters_nothing_without_its_record(
    tmp_path, postgres_url, postgres_proxy, unique
) -> None:
    app = test_app(tmp_path, clock=RestoringClock(postgres_proxy), store=proxied_url(postgres_url, postgres_proxy), cache="none",
                   settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    app.store.count_dead_letters(unique)  # tables ready before the cut
    handled: list[str] = []
    transport_dlq_during_outage: list[int] = []

    @app.handler("orders", group=unique, token="body.id", batch=10)
    def handle(msgs: list[Message], tx) -> None:
        handled.extend(m.body["id"] for m in msgs)

    app.publish_many("orders", [{"id": "a"}, {"no-id": 1}, {"id": "b"}])
    cut_once_the_store_answers(app, postgres_proxy)
    app.runtime.clock.sleep = _noting(app.runtime.clock.sleep, lambda: transport_dlq_during_outage.append(
        len(dead_letter_queue(app, unique))))
    app.run(until_idle=True)

    assert transport_dlq_during_outage[0] == 0  # while the store was down: nothing handed to the DLQ
    assert app.stats()["deferred"] >= 3
    assert sorted(handled) == ["a", "b"]
    (letter,) = app.dead_letters(unique)
    assert letter.message.body == {"no-id": 1} and letter.failure.error_type.endswith("TokenMissingError")
    assert [m.body for m in dead_letter_queue(app, unique)] == [{"no-id": 1}]
    app.close()


def _noting(sleep, note):
    def noted(seconds: float) -> None:
        note()
        sleep(seconds)

    return noted


def test_lease_mode_store_cut_after_the_side_effect_is_not_acked_and_stays_consistent(
    tmp_path, postgres_url, postgres_proxy, unique
) -> None:
    app = test_app(tmp_path, clock=RestoringClock(postgres_proxy), store=proxied_url(postgres_url, postgres_proxy), cache="none",
                   settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    calls: list[int] = []

    @app.handler("mail", group=unique, token="body.id", lease=5.0)
    def send(msg: Message) -> str:
        calls.append(msg.attempt)
        if len(calls) == 1:
            postgres_proxy.cut()  # the outside call happened; the store goes down before its result is stored
        return f"sent {len(calls)}"

    app.publish("mail", {"id": "m-1"})
    app.run(until_idle=True)  # must not raise: the outage stays inside the pipeline

    assert len(calls) == 2  # not acked: after the lease expired the redelivery ran it again (at least once)
    stats = app.stats()
    assert stats["deferred"] >= 1 and stats["processed"] == 1
    app.publish("mail", {"id": "m-1"})
    app.run(until_idle=True)
    assert len(calls) == 2 and app.stats()["duplicate"] == 1  # the stored result answers the duplicate
    assert app.dead_letters(unique) == []
    app.close()
