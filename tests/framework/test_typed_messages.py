"""Typed messages: bodies validated into pydantic models and dataclasses; what fails is poison."""

from __future__ import annotations

import dataclasses
import datetime

from pydantic import BaseModel

import reliable
from reliable import App
from reliable.testing import dead_letter_queue


class Order(BaseModel):
    id: str
    amount: int


@dataclasses.dataclass
class Shipment:
    order_id: str
    at: datetime.datetime


def test_a_model_annotation_gets_the_validated_body(app: App) -> None:
    got: list[Order] = []

    @app.handler("orders", token="body.id")
    def handle(order: Order) -> None:
        got.append(order)

    app.publish("orders", Order(id="o1", amount=3))  # a model is published as its JSON form
    app.publish("orders", {"id": "o2", "amount": "4"})  # pydantic's lax mode: "4" -> 4
    app.run(until_idle=True)

    assert got == [Order(id="o1", amount=3), Order(id="o2", amount=4)]


def test_message_of_a_dataclass_keeps_the_envelope(app: App) -> None:
    got: list[tuple[str | None, Shipment]] = []

    @app.handler("shipments", token="body.order_id")
    async def handle(msg: reliable.Message[Shipment], tx) -> None:
        got.append((msg.key, msg.body))

    at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    app.publish("shipments", Shipment("o1", at), key="k1")
    app.run(until_idle=True)

    assert got == [("k1", Shipment("o1", at))]


def test_a_body_that_does_not_validate_is_dead_lettered_at_once_with_its_errors(app: App) -> None:
    ran: list[Order] = []

    @app.handler("orders", token="body.id", in_process=3)
    def handle(order: Order, tx) -> None:
        ran.append(order)

    app.publish("orders", {"id": "o1", "amount": "lots"})
    app.run(until_idle=True)

    assert ran == []
    [letter] = app.dead_letters("handle")
    assert letter.failure.error_type == "reliable.errors.BodyValidationError"
    assert letter.failure.attempts == 1
    assert "amount" in letter.failure.error_message and "int_parsing" in letter.failure.error_message
    assert letter.message.payload == b'{"id":"o1","amount":"lots"}'  # stored unchanged
    stats = app.stats()
    assert stats["dead_lettered"] == 1 and stats["retried"] == 0 and stats["processed"] == 0
    assert len(dead_letter_queue(app, "handle")) == 1


def test_a_plain_message_annotation_is_not_a_body_type(app: App) -> None:
    got: list[dict] = []

    @app.handler("orders", token="body.id")
    def handle(msg: reliable.Message) -> None:
        got.append(msg.body)

    app.publish("orders", {"id": "o1"})
    app.run(until_idle=True)
    assert got == [{"id": "o1"}]
