"""A Spark driver for `test_driver_kill.py`: streams order files into PostgreSQL through `foreach_batch`.

``python -m tests.spark.driver_child SOURCE CHECKPOINT STORE TABLE SINK HOLD_AFTER MARKERS``

After the wrapper has committed batch ``HOLD_AFTER`` (the sink wrote), the
driver writes ``MARKERS/written-<batch>`` and blocks inside the batch
function, so Spark has not recorded the batch in its checkpoint: the test
kills this process with SIGKILL right there. ``HOLD_AFTER`` -1 holds nothing.
Each batch's report goes to ``MARKERS/report-<pid>.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from reliable.spark import foreach_batch, insert_rows
from reliable.spark.session import local_session
from reliable.testing import test_app
from tests.spark.streams import run_stream


def main(source: str, checkpoint: str, store: str, table: str, sink: str, hold_after: int,
         markers: str) -> None:
    folder = Path(markers)
    app = test_app(folder / f"app-{os.getpid()}", store=store)
    reports = folder / f"report-{os.getpid()}.jsonl"

    @foreach_batch(app, name=table, token="order_id", sink=sink)
    def write(df, batch_id, tx):
        insert_rows(df, tx, table)

    def batch_function(df, batch_id):
        report = write(df, batch_id)
        with reports.open("a") as out:
            out.write(json.dumps({"batch_id": batch_id, "status": report.status.value}) + "\n")
        if batch_id == hold_after:
            (folder / f"written-{batch_id}").touch()
            threading.Event().wait()  # the sink wrote; Spark's commit of this batch never comes

    spark = local_session("reliable-driver-kill")
    run_stream(spark, Path(source), Path(checkpoint), batch_function)
    spark.stop()


if __name__ == "__main__":
    source, checkpoint, store, table, sink, hold_after, markers = sys.argv[1:8]
    main(source, checkpoint, store, table, sink, int(hold_after), markers)
