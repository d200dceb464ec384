"""The main example: a billing consumer that charges each payment exactly once.

Run it on embedded defaults (broker in process, SQLite, in-memory cache, all
under ./.reliable/example/, see ``examples/payments.toml``) with
``scripts/dev example``, or ``python -m examples.payments`` from the
repository's root. The worker alone: ``reliable run examples.payments:app``.

It publishes five payments: one twice (a duplicate), one with a bad amount
(a fatal error: dead-lettered after one attempt) and one whose gateway is
down on the first delivery (retried in process, redelivered, then charged).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

import reliable

app = reliable.App.from_settings(Path(__file__).with_name("payments.toml"))


class GatewayDown(Exception):
    """The payment gateway did not answer (transient)."""


@app.handler(
    "payments",
    group="billing",
    token="body.payment_id",
    retry=reliable.RedeliveryPolicy(initial_delay=0.2, multiplier=2.0, max_delay=5, jitter=0.15, max_redeliveries=4),
    fatal=(ValueError,),
)
def charge(msg: reliable.Message, tx) -> None:
    payment = msg.body
    if payment["amount"] <= 0:
        raise ValueError(f"amount must be positive, got {payment['amount']}")
    if payment.get("gateway") == "flaky" and msg.attempt == 1:
        raise GatewayDown("gateway timed out")
    tx.execute(
        text("insert into charges(id, amount, attempt) values (:i, :a, :n)"),
        {"i": payment["payment_id"], "a": payment["amount"], "n": msg.attempt},
    )


def create_tables() -> None:
    with app.store.transaction() as tx:
        tx.execute(text("create table if not exists charges (id text primary key, amount numeric, attempt integer)"))


def main() -> None:
    for payment in (
        {"payment_id": "p-1", "amount": 10},
        {"payment_id": "p-2", "amount": 25},
        {"payment_id": "p-1", "amount": 10},  # delivered twice: a duplicate
        {"payment_id": "p-3", "amount": -5},  # can never succeed: poison
        {"payment_id": "p-4", "amount": 7, "gateway": "flaky"},  # fails once, then succeeds
    ):
        app.publish("payments", payment)
    app.run(until_idle=True)

    with app.store.transaction() as tx:
        charges = tx.execute(text("select id, amount, attempt from charges order by id")).all()
    print("\ncharges written (id, amount, delivery attempt):")
    for row in charges:
        print(f"  {row.id}: {row.amount} (attempt {row.attempt})")
    print("\ncounters:", app.stats())
    print("\ndead letters of group 'billing':")
    for letter in app.dead_letters("billing"):
        body = letter.message.payload.decode()
        print(f"  #{letter.id} {body} -> {letter.failure.error_type}: {letter.failure.error_message}"
              f" after {letter.failure.attempts} attempt(s)")
    app.close()


create_tables()  # a worker started with `reliable run examples.payments:app` needs it too

if __name__ == "__main__":
    main()
