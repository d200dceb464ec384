"""Fixtures shared by the whole suite: the real services, and clean namespaces on them.

Tests use real PostgreSQL, Redis and RabbitMQ through ``DATABASE_URL``,
``REDIS_URL`` and ``AMQP_URL`` (defaulting to the local ports). A service that
cannot be reached skips its tests locally and fails them under ``CI=true``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import structlog
from hypothesis import settings
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
IN_CI = os.environ.get("CI", "").lower() == "true"

pytest_plugins = ["tests.scheduling"]  # how pytest-xdist spreads the suite over its workers

# Hypothesis fails an example that takes over 200 ms: a timing assert, which a loaded machine
# breaks (a STOMP codec example took 272 ms under a load of 30). Timing belongs in benchmarks/.
settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")


# The suite starts about fifteen Spark JVMs that live seconds (sessions, killed drivers, the examples).
# For them the C2 compiler and the parallel collector cost more CPU than they give back: C1 alone and
# the serial collector took the Spark example test from 40 to 27 CPU-seconds. A Spark start loads
# some 15,000 classes from Spark's own jars: verifying their bytecode, and the full collections that
# the default 21 MB first metaspace threshold triggers four times, cost about 3.5 of the 22
# CPU-seconds of a session that runs one small query (median of 10 runs; 18.8 without them).
# Tests only (inherited by the processes they start): `local_session` and the benchmarks keep the
# JVM's defaults.
os.environ.setdefault(
    "JDK_JAVA_OPTIONS",
    "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:MetaspaceSize=256m"
    " -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote",
)

# tmp_path on tmpfs (pytest's documented PYTEST_DEBUG_TEMPROOT; a numbered folder per run, as under /tmp).
# The broker stores and SQLite databases of the tests fsync: on the root disk each fsync cost system CPU
# and journal work, and the suite's wall time is its CPU time (test_recovery.py: 13.8 CPU-seconds on
# ext4, 10.7 on tmpfs; test_simulation.py: 24.2 and 18.6). A kill -9 leaves the page cache as it is on
# either, so every crash test keeps its meaning (none of them cuts the power).
if os.access("/dev/shm", os.W_OK):
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", "/dev/shm")

SOAK_TIMEOUT = 3600  # seconds: a soak runs many times longer than pytest-timeout's default for a test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Soaks get `SOAK_TIMEOUT` unless they name their own timeout."""
    for item in items:
        if item.get_closest_marker("soak") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SOAK_TIMEOUT))


def _reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), 2):
            return True
    except OSError:
        return False


def require_service(name: str, url: str, default_port: int) -> str:
    """Return ``url`` if the service answers; skip (fail under CI=true) if not."""
    if _reachable(url, default_port):
        return url
    message = f"{name} is not reachable at {url}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    return require_service("PostgreSQL", DATABASE_URL, 5432)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return require_service("Redis", REDIS_URL, 6379)


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """The shared RabbitMQ; when the process's tests are done, nothing may be left on it under their
    names (`tests.rabbit_leftovers`): what is left is deleted, and the run fails naming the tests."""
    yield require_service("RabbitMQ", AMQP_URL, 5672)
    from tests import rabbit_leftovers

    found = rabbit_leftovers.leftovers(_UNIQUE_OWNERS)
    if found:
        rabbit_leftovers.delete(AMQP_URL, found)
        pytest.fail("tests left queues or exchanges on RabbitMQ (deleted now):\n"
                    + rabbit_leftovers.report(found, _UNIQUE_OWNERS))


@pytest.fixture(scope="session")
def nats_url() -> str:
    return require_service("NATS", NATS_URL, 4222)


_UNIQUE_NAMES: list[str] = []
_UNIQUE_OWNERS: dict[str, str] = {}
"""Each `unique` name of this process, and the test it was made for."""


@pytest.fixture
def unique(request: pytest.FixtureRequest) -> str:
    """A fresh name for a group, topic or namespace, so tests never see each other's data."""
    name = f"t{uuid.uuid4().hex[:12]}"
    _UNIQUE_NAMES.append(name)
    _UNIQUE_OWNERS[name] = request.node.nodeid
    return name


@pytest.fixture(scope="session", autouse=True)
def _forget_test_rows() -> Iterator[None]:
    """After the run (of each xdist worker: the names are the process's own), delete what tests
    left in the shared PostgreSQL tables under their names and the names made of them (`DERIVED`):
    without those, each run left the outbox chains' and the Spark pipeline's 160,000 token rows
    behind, and ``reliable_tokens`` had grown to 960,000 rows.

    Each table in a transaction of its own, retried when PostgreSQL picks it as a deadlock's
    victim (other workers and other runs write and delete in the same tables meanwhile)."""
    yield
    if not _UNIQUE_NAMES or not _reachable(DATABASE_URL, 5432):
        return
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.exc import OperationalError

    engine = create_engine(DATABASE_URL)
    forget = retry(retry=retry_if_exception_type(OperationalError), stop=stop_after_attempt(5),
                   wait=wait_random(0.05, 0.5), reraise=True)(_delete_rows)
    try:
        tables = set(inspect(engine).get_table_names())
        for table, column in (("reliable_tokens", "namespace"), ("reliable_dead_letters", '"group"'),
                              ("reliable_offsets", '"group"'), ("reliable_outbox", "outbox"),
                              ("reliable_outbox_sent_rows", "outbox")):
            if table in tables:
                forget(engine, text(f"delete from {table} where {column} = any(:names)"))
    finally:
        engine.dispose()


DERIVED = ("{}", "{}-a", "{}-b", "pipeline-{}", "g-{}")
"""The names tests make of a `unique` name for their groups and namespaces (matched whole, through
the tables' indexes: a pattern match read all of ``reliable_tokens``, 1.7 s at 960,000 rows)."""


def _delete_rows(engine: Any, statement: Any) -> None:
    with engine.begin() as conn:
        conn.execute(statement, {"names": [form.format(name) for name in _UNIQUE_NAMES for form in DERIVED]})


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real, small disk (`tests.disk.SIZE` of tmpfs) for full-disk tests: skipped without root
    locally, failed under CI=true."""
    from tests.disk import mounted

    try:
        with mounted(tmp_path / "small") as mount:
            yield mount
    except PermissionError as exc:
        if IN_CI:
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture
def small_postgres(postgres_url: str, unique: str) -> Iterator[Any]:
    """A PostgreSQL database (`tests.disk.SmallDatabase`) whose tables all live on a small disk
    (`tests.disk.SIZE` of tmpfs); skipped without root locally, failed under CI=true."""
    from sqlalchemy import create_engine

    from tests.disk import SmallDatabase, mounted, postgres_on, server_user

    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    mount = Path(tempfile.mkdtemp(prefix="reliable-pg-disk-"))  # the server's user cannot enter tmp_path
    try:
        with mounted(mount, owner=server_user(admin)) as disk, postgres_on(disk, admin, unique) as url:
            yield SmallDatabase(url, disk)
    except PermissionError as exc:
        if IN_CI:
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    finally:
        admin.dispose()
        if not mount.is_mount():  # left mounted when PostgreSQL still uses it (`tests.disk.StillInUse`)
            mount.rmdir()


@pytest.fixture
def sqlite_url(tmp_path) -> Iterator[str]:
    yield f"sqlite:///{tmp_path / 'store.db'}"


from tests.transports.kafka_place import kafka_url  # noqa: E402, F401  (the kafka:// contract entry)
from tests.transports.reliable_place import reliable_server  # noqa: E402, F401  (reliable://)


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Each test starts with structlog's defaults: a CLI run in process (click's CliRunner) or an
    App configures it (warning level, say), and a later `capture_logs` must still see info events."""
    yield
    structlog.reset_defaults()
