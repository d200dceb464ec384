"""One local SparkSession for the whole test run (``spark``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reliable.spark.session import local_session

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """local[2], two shuffle partitions, no UI: one per test run (it takes seconds to start)."""
    # Spark's Python workers import the test modules' functions (validate steps) by name.
    paths = [
        str(ROOT),
        str(ROOT / "tests"),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    session = local_session("reliable-tests", **{"spark.default.parallelism": "2"})
    yield session
    session.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "filterwarnings", "ignore:PySpark does not yet fully support pandas:FutureWarning"
    )
