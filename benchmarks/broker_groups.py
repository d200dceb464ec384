"""What a new consumer group costs the broker as the topic table grows: join and leave a new
group (its ``%RETRY%`` topic made, fsynced) over a broker holding N topics, on the disk of
``--dir`` (a tmpfs makes every fsync free: use a real disk).

Each new topic, and so each new group, rewrote and fsynced the whole topic table: with 10,000
topics a new group took 28.5 ms; appended to ``topics.journal`` it takes 1.9 ms (2 cores, shared).

    python -m benchmarks.broker_groups [--topics 1000 10000] [--groups 200] [--dir PATH]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import structlog

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage


def per_group(directory: str, topics: int, groups: int) -> float:
    """Milliseconds per new group's join and leave over a broker holding ``topics`` topics."""
    with tempfile.TemporaryDirectory(dir=directory, prefix="broker-groups-") as folder:
        broker = Broker(folder, DeliveryConfig(queues=1, max_topics=topics + 1))
        try:
            for n in range(topics):
                broker.publish(f"topic-{n:06}", [OutgoingMessage(b"x")])
            started = time.perf_counter()
            for n in range(groups):
                broker.leave(broker.join(f"group-{n}", ["topic-000000"]))
            return (time.perf_counter() - started) / groups * 1000
        finally:
            broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--dir", default=".", help="where the brokers go, each in a temporary folder removed after it (a real disk; default: here)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(f"{'topics':>8}  {'ms per new group':>16}")
    for topics in args.topics:
        print(f"{topics:>8}  {per_group(args.dir, topics, args.groups):>16.2f}")


if __name__ == "__main__":
    main()
