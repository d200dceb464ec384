"""How pytest-xdist spreads the suite over its workers (``scripts/dev test`` runs ``-n 4 --dist loadgroup``).

Every test is a unit of work of its own: an idle worker takes the next one. Two
exceptions, both declared here and nowhere else:

* `ONE_WORKER`: tests whose node id matches one of these patterns form a
  group that runs on one worker, one test after another, in collection order
  (the Spark tests share that worker's one SparkSession, but for those that
  start a Spark driver of their own; the README's blocks share the
  repository's example folder and follow one another; the RabbitMQ cluster
  tests share one 3-node cluster). Groups are
  handed out first, the largest first, and hold their worker until done: keep
  them few and short.
* `START_FIRST`: the slowest tests (crash and kill loops, soaks of real
  servers) are moved to the front, so none of them starts last and the run
  does not end on one worker finishing a long test alone.

Why not pytest-xdist's own ``xdist_group`` marker: xdist 3.8 carries a test's
group to the controller by rewriting ``item._nodeid``, which pytest 9 no longer
reads, so under pytest 9 the marker silently groups nothing. The controller
only sees node ids, so the groups are declared by node id pattern (`fnmatch`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import pytest

ONE_WORKER: dict[str, str | None] = {
    # Spark in a driver process of the test's own, not the worker's SparkSession: any worker
    "tests/spark/test_driver_kill.py::*": None,
    "tests/spark/test_example.py::*": None,
    "tests/spark/test_pipeline.py::*": None,
    "tests/spark/*": "spark",
    "tests/test_readme.py::*": "readme",
    "tests/cluster/test_rabbit_cluster.py::*": "rabbit cluster",  # one 3-node cluster (module fixture)
    "tests/transports/test_amqp_server_events.py::*alarm*": "rabbit alarms",  # one node of their own
}
"""Node id pattern -> group: the group's tests run on one worker, in order. The first pattern
that matches decides; None means any worker."""

START_FIRST: tuple[str, ...] = (
    "tests/transports/*::test_kill_9_at_random_points_*",  # 20 kills over 10,000 tokens: Kafka 135 s, the longest
    "tests/spark/test_pipeline.py::*",  # producers, a broker server and a Spark driver, killed: 110-125 s
    "tests/spark/test_example.py::*",
    "tests/spark/test_driver_kill.py::*",
    "tests/transports/test_chaos.py::test_kill_9_of_an_async_handler_*",  # 52 s (377 s before forked workers)
    "tests/cluster/*::*",  # 3-node clusters started by the test
    "tests/test_readme_benchmarks.py::*",  # Spark and broker benchmarks in child processes
    "tests/framework/test_transport_faults.py::*kill_9*",
    "tests/framework/test_exactly_once.py::*kill_9*",
    "tests/framework/test_cli.py::*",  # a `reliable` process per command
    "tests/console/test_console_browser.py::*",  # Chromium, 10,000 dead letters
    "tests/broker/test_crash.py::*",
    "tests/broker/server/test_server_kill.py::*",
    "tests/framework/test_sigterm*.py::*",
    "tests/framework/test_two_processes.py::*",
    "tests/framework/test_on_broker_server.py::*killed*",
    "tests/transports/test_kafka*.py::*",
)
"""Node id patterns of the slowest tests (``--durations``, one directory at a time), slowest
first: they start first, in this order."""


def group_of(nodeid: str) -> str | None:
    """The `ONE_WORKER` group of the test ``nodeid``, or None when any worker may run it."""
    return next((group for pattern, group in ONE_WORKER.items() if fnmatchcase(nodeid, pattern)), None)


def start_rank(nodeid: str) -> int:
    """Where ``nodeid`` starts: its `START_FIRST` position, after all of them if none."""
    return next((n for n, pattern in enumerate(START_FIRST) if fnmatchcase(nodeid, pattern)),
                len(START_FIRST))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadgroup``: one unit of work per test, one per `ONE_WORKER` group."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling, the scope of a test being its group or itself.

        `LoadScopeScheduling` hands out the largest scopes first, then the others
        in collection order (which `pytest_collection_modifyitems` sorted).
        """

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or nodeid

    return GroupScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, `START_FIRST` tests come first (every worker sorts alike)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: start_rank(item.nodeid))
