"""The relay through a real network outage of the broker server (``reliable://`` behind a `TcpProxy`).

* a publish the server carried out whose reply is lost: nobody on the
  relay's side can know it was appended, so the batch is sent again (by the
  client's reconnect, else by the relay's next pass) with the same ids, which
  the broker drops: the consumer gets each message once;
* a cut: the relay backs off while the server cannot be reached, loses no
  row, and sends everything once it can;
* a store nobody listens on under ``run(until_idle=True)``: the wait between
  drains grows over the outage instead of starting again at each drain.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from structlog.testing import capture_logs

from backends.store.outbox import RowState
from backends.transport import open_transport
from reliable import App, Message
from reliable.testing import test_app
from tests.cluster.ports import free_ports
from tests.tcp_proxy import TcpProxy
from tests.transports.effects import wait_until


@pytest.fixture
def proxy(reliable_server) -> Iterator[TcpProxy]:
    address = urlsplit(reliable_server.url)
    proxy = TcpProxy(address.hostname or "127.0.0.1", address.port or 0)
    yield proxy
    proxy.close()


@pytest.fixture
def app(tmp_path: Path, proxy: TcpProxy, unique: str) -> Iterator[App]:
    # a publish gives up after 1 s of reconnecting (not 30), so the relay's own backoff shows soon
    app = test_app(tmp_path, transport=f"reliable://127.0.0.1:{proxy.port}?publish_retry=1",
                   settings={"RELIABLE_OUTBOX__NAME": unique, "RELIABLE_OUTBOX__MAX_BACKOFF": "0.2"})
    yield app
    app.close()


def everything(reliable_server, topic: str, group: str, count: int) -> list[Message]:
    """All ``group`` gets of ``topic`` (straight from the server, acked), checked to end at ``count``."""
    transport = open_transport(reliable_server.url)
    got: list[Message] = []
    with transport.subscribe(group, [topic]) as subscription:
        while len(got) < count:
            batch = subscription.fetch(count, timeout=10.0)
            assert batch, f"{len(got)} of {count} arrived"
            subscription.ack(batch)
            got += batch
        assert subscription.fetch(count, timeout=0.5) == []  # and nothing after them: no copy
    transport.close()
    return got


def test_a_lost_confirmation_sends_the_rows_again_and_the_broker_drops_the_copies(
    app: App, proxy: TcpProxy, reliable_server, unique: str
) -> None:
    topic = f"{unique}-events"
    app.transport.declare(unique, [topic])
    with app.store.transaction() as tx:
        ids = [tx.publish(topic, {"n": n}, key="k") for n in range(50)]
    proxy.lose_next_reply()  # the server appends the batch; the relay never hears it did
    while app.relay().drain():
        pass
    assert proxy.replies_lost == 1  # the append happened and its confirmation was lost
    assert {r.state for r in app.store.outbox.rows()} == {RowState.SENT}
    got = everything(reliable_server, topic, unique, 50)
    assert [m.id for m in got] == ids  # each once, in order: the resend was dropped by id


def test_a_cut_holds_the_rows_back_until_the_server_is_reachable_again(
    app: App, proxy: TcpProxy, reliable_server, unique: str
) -> None:
    topic = f"{unique}-events"
    app.transport.declare(unique, [topic])
    proxy.cut()
    with capture_logs() as logs, app.relay().running():
        with app.store.transaction() as tx:
            ids = [tx.publish(topic, {"n": n}, key=f"k{n % 3}") for n in range(30)]
        wait_until(lambda: sum(e["event"] == "relay_backoff" for e in logs) >= 3, every=0.05)
        assert app.store.outbox.status().backlog == 30  # nothing lost, nothing marked sent
        proxy.restore()
        wait_until(lambda: app.store.outbox.status().backlog == 0, every=0.05)
    got = everything(reliable_server, topic, unique, 30)
    assert sorted(m.id for m in got) == sorted(ids)


def test_until_idle_through_a_store_outage_backs_off_across_drains(tmp_path: Path, unique: str) -> None:
    """`run(until_idle=True)` drains the outbox between polls. Each drain began its backoff anew
    (attempts 1, 2, 3, then 1, 2, 3 again, at most 0.2 s apart), so `reliable run --until-idle`
    on a store URL with a wrong password logged 37 lines a second until it was killed. The
    attempts now go on counting over the drains of one outage, and the wait grows with them."""
    [port] = free_ports(1)
    app = test_app(tmp_path, store=f"postgresql+psycopg://postgres@127.0.0.1:{port}/test",
                   settings={"RELIABLE_OUTBOX__NAME": unique})

    @app.handler(unique)
    def handle(msg: Message) -> None:
        pass

    with capture_logs() as logs:
        worker = threading.Thread(target=app.run, kwargs={"until_idle": True})
        worker.start()
        try:
            wait_until(lambda: sum(e["event"] == "relay_backoff" for e in logs) >= 8, every=0.05)
        finally:
            app.stop()
            worker.join()
            app.close()
    attempts = [e["attempt"] for e in logs if e["event"] == "relay_backoff"]
    assert attempts == list(range(1, len(attempts) + 1))
