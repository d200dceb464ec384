"""A worker process for the two-process and kill -9 tests (configured by environment).

    python -m tests.framework.worker_process TABLE publish N   # publish tokens t0..tN-1
    python -m tests.framework.worker_process TABLE publish M:N # publish tokens tM..tN-1
    python -m tests.framework.worker_process TABLE consume [BATCH]
"""

from __future__ import annotations

import json
import sys
import time

from sqlalchemy import text

from reliable import App


def main(table: str, mode: str, arg: str | None) -> None:
    app = App()  # settings from RELIABLE_* environment variables
    batch = int(arg) if mode == "consume" and arg else None

    @app.handler("work", group=table, token="body.token", batch=batch)
    def handle(msgs, tx) -> None:
        for m in msgs if isinstance(msgs, list) else [msgs]:
            tx.execute(text(f"insert into {table} (token, pid) values (:t, :p)"), {"t": m.body["token"], "p": _pid()})
            time.sleep(0.002)  # widen the window in which a twin or a kill can land

    if mode == "publish":
        first, _, count = (arg or "0").rpartition(":")
        app.publish_many("work", [{"token": f"t{i}"} for i in range(int(first or 0), int(count))])
        if len(sys.argv) > 4:  # publish and consume in one process (two-process race)
            app.run(until_idle=True)
    else:
        app.run(until_idle=True)
    print(json.dumps(app.stats()), flush=True)
    app.close()


def _pid() -> int:
    import os

    return os.getpid()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
