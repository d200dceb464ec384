"""What a RabbitMQ server does to a running ``amqp://`` worker and to ``app.publish``.

The worker's queue deleted under it (``rabbitmqctl delete_queue``, or ``queue.delete`` from
another client): RabbitMQ cancels the consumer, and the old worker waited for ever on a queue
that was gone, saying nothing, while a publisher declared it anew and filled it. Real RabbitMQ.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from structlog.testing import capture_logs

from backends.transport.amqp_layout import Layout
from backends.transport.amqp_transport import AmqpTransport
from reliable import App, Message
from reliable.settings import Settings
from tests.framework.refusals import Running
from tests.waiting import wait_until


def worker_app(folder: Path, url: str, done: list[int]) -> App:
    app = App(Settings.load(None, env={"RELIABLE_STORE__URL": f"sqlite:///{folder / 'store.db'}",
                                       "RELIABLE_TRANSPORT__URL": url}))

    @app.handler("orders", group="shipping")
    def ship(msg: Message, tx: object) -> None:
        done.append(msg.body["n"])

    return app


@pytest.fixture
def namespace(amqp_url: str, unique: str) -> Iterator[str]:
    """A namespace of the test's own on the shared RabbitMQ; its queues deleted afterwards."""
    yield unique
    with AmqpTransport(amqp_url, namespace=unique) as transport:
        transport.declare("shipping", ["orders"])  # so that purge knows the group's queues
        transport.purge()


def queue_exists(amqp_url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        connection.channel().queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False
    finally:
        connection.close()


def test_a_worker_whose_queue_is_deleted_declares_it_again_and_goes_on(
    tmp_path: Path, amqp_url: str, namespace: str
) -> None:
    done: list[int] = []
    app = worker_app(tmp_path, f"{amqp_url}?namespace={namespace}", done)
    queue = Layout(namespace).queue("orders", "shipping")
    with capture_logs() as logs:
        run = Running(app)
        app.publish("orders", {"n": 1})
        wait_until(lambda: done == [1], "the first message handled")
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        connection.channel().queue_delete(queue)
        connection.close()
        wait_until(lambda: queue_exists(amqp_url, queue), "the worker to declare its queue again")
        app.publish("orders", {"n": 2})
        wait_until(lambda: done == [1, 2], "the message published after the deletion handled")
        app.stop()
        run.join()
    assert run.error is None, run.error
    (left,) = [e for e in logs if e["event"] == "transport_unavailable"]
    assert f"cancelled the consumer of group 'shipping' on queue {queue!r}" in left["error"]
    assert "deleted" in left["error"]
    app.close()
