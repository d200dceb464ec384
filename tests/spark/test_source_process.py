"""What the source costs the fresh Python process Spark starts for a query's offsets.

Spark runs the driver's half of the reader (`initialOffset`, `latestOffset`, `commit`) in a new
process at every query start, so whatever that half imports is paid per query. An embedded
directory with an owner is read through the owner's socket: no engine, no store, no Arrow there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from broker.delivery.values import OutgoingMessage
from broker.embedded import open_embedded

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("broker.delivery.engine", "broker.store", "broker.embedded", "pyarrow", "numpy", "structlog")
OFFSETS = """
import json, sys
from reliable.spark.source import ReliableStreamReader
reader = ReliableStreamReader({"url": "embedded://" + sys.argv[1], "topic": "orders"})
start = reader.initialOffset()
end = reader.latestOffset(start, reader.getDefaultReadLimit())
print("offsets:", json.dumps({"start": start, "end": end, "api": type(reader.api).__name__,
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in {"pyarrow", "numpy", "structlog"}
                                  or m.startswith(("broker.delivery.engine", "broker.store", "broker.embedded")))}))
reader.stop()
"""


def offsets_process(directory: Path) -> dict:
    """What a fresh process (as Spark's source runner) reports for the topic's offsets."""
    done = subprocess.run([sys.executable, "-c", OFFSETS, str(directory)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("offsets: "))[9:])


def test_an_owned_directory_is_read_through_the_owners_socket_without_the_engine(tmp_path):
    owner = open_embedded(tmp_path / "broker")
    try:
        owner.publish("orders", [OutgoingMessage(b'{"n": %d}' % n) for n in range(10)])
        seen = offsets_process(tmp_path / "broker")
    finally:
        owner.close()
    assert seen["api"] == "LocalClient"
    assert seen["heavy"] == []  # checked: the names above are what importing broker.embedded loads
    assert sum(seen["end"].values()) - sum(seen["start"].values()) == 10


def test_a_directory_nobody_serves_is_opened_as_before(tmp_path):
    owner = open_embedded(tmp_path / "broker")
    owner.publish("orders", [OutgoingMessage(b'{"n": %d}' % n) for n in range(10)])
    owner.close()  # nobody serves it now: the reader's process owns it for its life, as before
    seen = offsets_process(tmp_path / "broker")
    assert seen["api"] == "EmbeddedBroker"
    assert "broker.delivery.engine" in seen["heavy"]
    assert sum(seen["end"].values()) - sum(seen["start"].values()) == 10
