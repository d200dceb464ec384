"""The server counts a fetch taken column by column as it counts the same deliveries one by one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from broker.delivery.values import Delivery, DeliveryColumns, joined
from broker.server.metrics import ServerMetrics


def counts(metrics: ServerMetrics) -> dict[str, float]:
    return {f"{family.name}{sorted(sample.labels.items())}": sample.value
            for metric in (metrics.delivered, metrics.bytes_out, metrics.redelivered)
            for family in metric.collect() for sample in family.samples
            if not sample.name.endswith("_created")}


def alike(taken: DeliveryColumns) -> bool:
    by_columns, by_deliveries = ServerMetrics(CollectorRegistry()), ServerMetrics(CollectorRegistry())
    by_columns.count_columns(taken)
    by_deliveries.count_deliveries(taken.deliveries())
    return counts(by_columns) == counts(by_deliveries)


def test_columns_and_deliveries_count_alike() -> None:
    first = [Delivery(f"r{n}", "orders", 0, n, f"m{n}", b"x" * n, delivery_count=1 + n % 3) for n in range(7)]
    second = [Delivery(f"s{n}", "events", 1, n, f"e{n}", b"yy", delivery_count=1) for n in range(4)]
    plain = DeliveryColumns(3, {"topic": "orders", "queue": 0, "key": "", "tag": "", "headers": {},
                                "delivery_count": 2, "published_at": 0.0},
                            {"receipt": ["a", "b", "c"], "offset": [1, 2, 3], "message_id": ["i", "j", "k"],
                             "body": [b"1", b"22", b"333"]})
    assert alike(plain)
    assert alike(joined([plain, DeliveryColumns.of(second)]))
    for deliveries in (first, second + first):
        assert alike(DeliveryColumns.of(deliveries))
