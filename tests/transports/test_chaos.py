"""The kill -9 chaos run (`tests/transports/chaos.py`) on `redis://` and `embedded://`, and the
outbox chain under kill -9 (`tests/transports/outbox_chain.py`) on those and `reliable://`.

Kafka, NATS and RabbitMQ run it in their own framework suites; these two
transports keep their leases themselves (a Lua script; the broker engine),
so a killed worker's messages come back when its lease ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.transports.chaos import kill_9_chaos
from tests.transports.outbox_chain import outbox_chain_with_kills

LEASE = 3.0
"""Seconds a killed worker's messages stay leased to it, and (embedded://) its queues assigned to it:
a member silent that long has lost its messages already, so its queues move on at the same bound
instead of the broker's default 30 s, which left every run waiting on its dead members."""
EMBEDDED = f"?session_timeout={LEASE}"


@pytest.mark.parametrize(("kills", "count"), [(20, 10_000), pytest.param(100, 50_000, marks=pytest.mark.soak)])
@pytest.mark.parametrize("transport", ["redis", "embedded"])
def test_kill_9_at_random_points_each_token_once_each_poison_dead_lettered_once(
    transport: str, tmp_path: Path, postgres_url: str, redis_url: str, effects: str, unique: str,
    kills: int, count: int,
) -> None:
    kill_9_chaos(_env(transport, tmp_path, postgres_url, redis_url, unique), postgres_url, effects, unique,
                 kills, count)


# an async def handler commits one message per transaction: 4,000 tokens keep the run within the
# suite's time on a loaded machine; the 10,000 run under the soak marker
@pytest.mark.parametrize(("kills", "count"), [(20, 4_000), pytest.param(20, 10_000, marks=pytest.mark.soak)])
@pytest.mark.parametrize("transport", ["redis", "embedded"])
def test_kill_9_of_an_async_handler_each_token_once_each_poison_dead_lettered_once(
    transport: str, tmp_path: Path, postgres_url: str, redis_url: str, effects: str, unique: str,
    kills: int, count: int,
) -> None:
    kill_9_chaos(_env(transport, tmp_path, postgres_url, redis_url, unique), postgres_url, effects, unique,
                 kills, count, handler="async")


@pytest.mark.parametrize("run", ["chaos", "outbox chain"])
def test_every_kill_lands_while_the_work_goes_on_however_short_the_work(
    run: str, tmp_path: Path, postgres_url: str, redis_url: str, effects: str, unique: str
) -> None:
    """A run whose work ends sooner than its kills can keep up (here 2,000 tokens for 20 kills; under
    load, a fast transport) still lands every kill before the work ends: the kills are placed at points
    of the work (`tests.transports.kill_points`), not at amounts of progress after the last kill."""
    env = _env("redis", tmp_path, postgres_url, redis_url, unique)
    if run == "chaos":
        kill_9_chaos(env, postgres_url, effects, unique, 20, 2_000)
    else:
        outbox_chain_with_kills(env, postgres_url, unique, 20, 2_000)


def _env(transport: str, tmp_path: Path, postgres_url: str, redis_url: str, unique: str) -> dict[str, str]:
    url = f"{redis_url}?namespace={unique}" if transport == "redis" else f"embedded://{tmp_path / 'broker'}{EMBEDDED}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update({
        "RELIABLE_TRANSPORT__URL": url,
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(LEASE),
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": redis_url,
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    })
    return env


@pytest.mark.parametrize(("kills", "count"), [(20, 10_000), pytest.param(100, 50_000, marks=pytest.mark.soak)])
@pytest.mark.parametrize("transport", ["embedded", "reliable", "redis"])
def test_outbox_chain_under_kill_9_each_b_effect_once_in_order_per_key(
    transport: str, request: pytest.FixtureRequest, tmp_path: Path, postgres_url: str, redis_url: str,
    unique: str, kills: int, count: int,
) -> None:
    urls = {
        "embedded": lambda: f"embedded://{tmp_path / 'broker'}{EMBEDDED}",
        "reliable": lambda: request.getfixturevalue("reliable_server").url,
        "redis": lambda: f"{redis_url}?namespace={unique}",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_")}
    env.update({
        "RELIABLE_TRANSPORT__URL": urls[transport](),
        "RELIABLE_TRANSPORT__VISIBILITY_TIMEOUT": str(LEASE),
        "RELIABLE_STORE__URL": postgres_url,
        "RELIABLE_CACHE__URL": redis_url,
        "RELIABLE_RETRY__INITIAL_DELAY": "0.5",
        "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1",
        "RELIABLE_LOG__LEVEL": "warning",
    })
    outbox_chain_with_kills(env, postgres_url, unique, kills, count)
