"""``app.publish`` tried again after a reply the broker server sent and the client never got.

A message published without a ``message_id`` was named at each try of
``app.publish``: the try after the lost reply was a new message to the broker
(and, on NATS, a new ``Nats-Msg-Id``), so it was stored twice and handled
twice. The framework now names it once, before the first try, and the broker
drops the copy by its id.
"""

from __future__ import annotations

import threading

from structlog.testing import capture_logs

from tests.framework.test_outbox_faults import app, everything, proxy  # noqa: F401 - fixtures
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until


def test_a_publish_tried_again_after_its_reply_was_lost_is_stored_once(
    app, proxy: TcpProxy, reliable_server, unique: str  # noqa: F811 - the fixtures imported above
) -> None:
    topic = f"{unique}-events"
    app.transport.declare(unique, [topic])
    app.publish(topic, {"n": 0})  # connected, its topic known: the next reply is a publish's
    # the server appends the message, its reply is lost, and the server is out of reach until the
    # client gave up (publish_retry=1) and app.publish waits to try again
    proxy.lose_next_reply(then_cut=True)
    with capture_logs() as logs:
        restored = threading.Thread(target=lambda: (
            wait_until(lambda: any(e["event"] == "publish_retried" for e in logs), "app.publish to retry"),
            proxy.restore()), daemon=True)
        restored.start()
        app.publish(topic, {"n": 1})  # no message_id: the caller leaves the naming to the framework
        restored.join()
    assert proxy.replies_lost == 1  # the append happened and its reply was lost
    got = everything(reliable_server, topic, unique, 2)  # and no second copy after them
    assert sorted(m.body["n"] for m in got) == [0, 1]
