"""The pipeline's producers: orders to the broker server, 5% sent twice, 1% that can never be valid.

    python -m examples.pipeline.produce reliable://127.0.0.1:7600 orders 100000

A duplicate is a second send of the same order (its token) as a new message:
the broker keeps both, the Spark job's tokens drop the copy. A poison order
has an amount that is not a number: the job's validate step dead-letters it.
Sends are retried across broker restarts with their message ids, so the
broker drops a resend that had already reached it.
"""

from __future__ import annotations

import json
import random
import sys
import uuid

from broker.client import Client
from broker.delivery.values import OutgoingMessage

JSON_HEADERS = {"content-type": "application/json"}


def orders(count: int, seed: int = 15) -> list[dict[str, str]]:
    """``count`` distinct orders; 1% poison (a bad amount)."""
    rng = random.Random(seed)
    return [{"token": f"o-{n}", "customer": f"c-{n % 97}",
             "amount": "oops" if rng.random() < 0.01 else f"{rng.randint(1, 9999) / 100:.2f}"}
            for n in range(count)]


def sends(count: int, seed: int = 15) -> list[dict[str, str]]:
    """What the producers send: every order once, 5% of them a second time, shuffled a little."""
    rng = random.Random(seed + 1)
    all_orders = orders(count, seed)
    twice = [order for order in all_orders if rng.random() < 0.05]
    sent = all_orders + twice
    rng.shuffle(sent)
    return sent


def produce(url: str, topic: str, count: int, batch: int = 500) -> int:
    client = Client(url, publish_retry_seconds=120)
    sent = sends(count)
    for start in range(0, len(sent), batch):
        client.publish(topic, [OutgoingMessage(json.dumps(order).encode(), key=order["token"],
                                               headers=JSON_HEADERS, message_id=uuid.uuid4().hex)
                               for order in sent[start:start + batch]])
    client.close()
    return len(sent)


if __name__ == "__main__":
    url, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(f"sent {produce(url, topic, count)} messages for {count} orders", flush=True)
