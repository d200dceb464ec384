"""A local SparkSession for examples, tests and benchmarks."""

from __future__ import annotations

import os
import sys
from typing import Any

_LOCAL_DEFAULTS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
}


def local_session(app_name: str, **config: str) -> Any:
    """A ``local[2]`` session without UI whose Python workers run this interpreter.

    ``config`` adds or overrides Spark settings (dots as in Spark: pass a dict with ``**``).
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers import reliable from this venv
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master("local[2]").appName(app_name)
    for key, value in {**_LOCAL_DEFAULTS, **config}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
