"""A worker whose log is a file on the disk it fills (`test_full_disk`): ``python -m`` this with
the disk as argument and stderr on a file there; it prints the effects once ``run()`` returns."""

from __future__ import annotations

import sys
from pathlib import Path

from sqlalchemy import text

from reliable.testing import test_app
from tests.disk import SpaceComesBack
from tests.framework.conftest import create_effects, effects

disk = Path(sys.argv[1])
clock = SpaceComesBack()
app = test_app(disk, clock=clock, transport=f"embedded://{disk / 'broker'}", settings={"RELIABLE_LOG__FORMAT": "json"})
create_effects(app, "effects")


@app.handler("orders", token="body.id")
def order(msg, tx):
    if clock.ballast is None and msg.body["id"] == 3:
        clock.fill(disk)  # the log file's disk too
    tx.execute(text("insert into effects (token, attempt) values (:t, :a)"), {"t": f"order-{msg.body['id']}", "a": 1})


for n in range(10):
    app.publish("orders", {"id": n})
try:
    app.run(until_idle=True)
    print("effects", *effects(app), flush=True)
finally:
    if clock.ballast is not None:
        clock.ballast.free()
    app.close()
