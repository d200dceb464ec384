"""What the tests left on the shared RabbitMQ: queues and exchanges named after their `unique` names.

Every queue and exchange a test declares carries its ``unique`` name (``t`` and
12 hex digits: the transport's namespace, or the name itself), and the test
deletes them. Left over, quorum queues pile up run after run until RabbitMQ runs
out of file handles. When an xdist worker (or a plain run) ends, the
``amqp_url`` fixture lists the server's queues and exchanges once
(`rabbitmqctl`, about 1 CPU-second: AMQP cannot list them), deletes those
under this process's names, and fails naming the tests that left them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping

NAME = re.compile(r"t[0-9a-f]{12}")
"""A `unique` name inside a queue's or an exchange's name."""


def listed(kind: str) -> list[str] | None:
    """The names of the server's ``kind`` (``queues``, ``exchanges``), or None without rabbitmqctl
    (a RabbitMQ elsewhere, or not ours to ask)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return None
    try:
        done = subprocess.run([ctl, "-q", f"list_{kind}", "name"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    return [line for line in done.stdout.splitlines() if line and line != "name"]


def leftovers(owners: Mapping[str, str]) -> dict[str, list[str]]:
    """``kind: names`` of the queues and exchanges whose name holds one of ``owners``' names."""
    found: dict[str, list[str]] = {}
    for kind in ("queues", "exchanges"):
        names = listed(kind) or []
        mine = [name for name in names if any(part in owners for part in NAME.findall(name))]
        if mine:
            found[kind] = sorted(mine)
    return found


def delete(amqp_url: str, found: Mapping[str, Iterable[str]]) -> None:
    """Delete ``found`` (as `leftovers` gives them) through AMQP."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        for queue in found.get("queues", ()):
            channel.queue_delete(queue)
        for exchange in found.get("exchanges", ()):
            channel.exchange_delete(exchange)
    finally:
        connection.close()


def report(found: Mapping[str, Iterable[str]], owners: Mapping[str, str]) -> str:
    """Which test left which queue or exchange."""
    lines = []
    for kind, names in found.items():
        for name in names:
            tests = sorted({owners[part] for part in NAME.findall(name) if part in owners})
            lines.append(f"  {kind[:-1]} {name}: {', '.join(tests)}")
    return "\n".join(lines)
