"""The Spark example as a user runs it: a driver killed after a commit, a restart, each order once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.spark.conftest import ROOT

pytestmark = pytest.mark.spark


def test_the_spark_example_writes_every_valid_order_once_through_a_crash(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "examples.spark_orders"],
        cwd=tmp_path,  # the example works under ./.reliable/spark-example
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    assert "driver killed after batch 2 committed" in run.stdout
    assert "batch 2: replayed" in run.stdout  # the restart's replay, skipped by the fence
    assert "each valid order written exactly once: YES" in run.stdout
