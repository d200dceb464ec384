"""Log-in throttling over real HTTP, from distinct client addresses (any of 127.0.0.0/8 is this
machine's): what a client guessing passwords gets, however it spreads its attempts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.clock import FakeClock
from broker.console.throttle import LoginThrottle
from broker.server.auth import Authenticator, Principal, load_users
from broker.server.throttle import Throttle, client_address
from tests.console.deployment import PASSWORDS, USERS, Deployment, start
from tests.console.http import Visitor
from tests.waiting import wait_until

LIMITS = {"login_max_failures": 3, "login_max_failures_per_address": 6, "login_window": 300,
          "login_lockout": 30, "login_max_lockout": 120}


class Gated(Authenticator):
    """The broker's users, counting the password checks and holding them while ``gate`` is shut."""

    def __init__(self) -> None:
        super().__init__(load_users(USERS))
        self.gate, self.lock = threading.Event(), threading.Lock()
        self.gate.set()
        self.checked = self.inside = self.most = 0

    def authenticate(self, login: str | None, password: str | None) -> Principal:
        with self.lock:
            self.checked, self.inside = self.checked + 1, self.inside + 1
            self.most = max(self.most, self.inside)
        try:
            self.gate.wait(30)
            return super().authenticate(login, password)
        finally:
            with self.lock:
                self.inside -= 1


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def users() -> Gated:
    return Gated()


@pytest.fixture
def deployment(tmp_path: Path, clock: FakeClock, users: Gated) -> Iterator[Deployment]:
    deployment = start(tmp_path, authenticator=users, clock=clock, **LIMITS)
    yield deployment
    deployment.console.stop()
    deployment.app.close()


def attempt(deployment: Deployment, user: str, password: str, source: str = "127.0.0.1",
            **headers: str) -> tuple[int, dict[str, str], str]:
    v = Visitor(deployment.url, source, headers)
    return v.request("POST", "/login", {"user": user, "password": password, "csrf": v.login_token()})


def test_failures_for_one_user_name_lock_it_out_for_a_growing_delay(deployment, clock, users) -> None:  # type: ignore[no-untyped-def]
    """From a new address each time: the user name's count does not care where attempts come from."""
    sources = iter(f"127.0.1.{n}" for n in range(1, 100))
    assert [attempt(deployment, "alice", "guess", next(sources))[0] for _ in range(3)] == [401] * 3
    status, headers, page = attempt(deployment, "alice", PASSWORDS["alice"], next(sources))
    assert (status, headers["retry-after"]) == (429, "30") and "try again in 30 s" in page
    assert users.checked == 3  # refused before the password was checked, the right one too
    for delay in (30, 60, 120):  # one more try once the lock-out ends; failing, it doubles, to the cap
        clock.advance(delay)
        assert attempt(deployment, "alice", "guess", next(sources))[0] == 401
        status, headers, _ = attempt(deployment, "alice", "guess", next(sources))
        assert (status, headers["retry-after"]) == (429, str(min(delay * 2, 120)))
    clock.advance(120)
    assert attempt(deployment, "alice", PASSWORDS["alice"], next(sources))[0] == 303
    # a success forgets the failures: three more before the next lock-out
    assert [attempt(deployment, "alice", "guess", next(sources))[0] for _ in range(4)] == [401] * 3 + [429]
    assert attempt(deployment, "bob", PASSWORDS["bob"], next(sources))[0] == 303  # other names unaffected


def test_one_address_trying_many_user_names_is_locked_out(deployment, clock) -> None:  # type: ignore[no-untyped-def]
    statuses = [attempt(deployment, f"user-{n}", "guess", "127.0.2.1")[0] for n in range(6)]
    assert statuses == [401] * 6
    status, headers, _ = attempt(deployment, "bob", PASSWORDS["bob"], "127.0.2.1")
    assert (status, headers["retry-after"]) == (429, "30")
    assert attempt(deployment, "bob", PASSWORDS["bob"], "127.0.2.2")[0] == 303  # another address is not


def test_logging_in_to_an_account_of_ones_own_does_not_reset_the_addresss_count(deployment) -> None:  # type: ignore[no-untyped-def]
    """carol, a user with rights on another team's group, tries one password over many user names
    (password spraying), logging in as herself every few guesses: each log-in forgot her address's
    failures, so its bound never came."""
    guesses = [attempt(deployment, f"user-{n}", "guess", "127.0.2.5")[0] for n in range(5)]
    assert guesses == [401] * 5
    assert attempt(deployment, "carol", PASSWORDS["carol"], "127.0.2.5")[0] == 303
    guesses = [attempt(deployment, f"user-{n}", "guess", "127.0.2.5")[0] for n in range(5, 7)]
    assert guesses == [401, 429]  # the sixth failure from the address locks it out


def test_x_forwarded_for_is_not_believed_from_a_client(deployment) -> None:  # type: ignore[no-untyped-def]
    """Without ``console_trusted_proxies``, a client naming a new address per attempt is still one."""
    statuses = [attempt(deployment, f"user-{n}", "guess", "127.0.3.1",
                        **{"X-Forwarded-For": f"198.51.100.{n}"})[0] for n in range(7)]
    assert statuses == [401] * 6 + [429]


def test_x_forwarded_for_names_the_client_behind_a_trusted_proxy(tmp_path: Path) -> None:
    deployment = start(tmp_path, clock=FakeClock(), trusted_proxies=["127.0.4.1"], **LIMITS)
    try:
        proxy = "127.0.4.1"
        for n in range(6):  # the client at 198.51.100.7, through the proxy, forging hops before its own
            forwarded = {"X-Forwarded-For": f"203.0.113.{n}, 198.51.100.7"}
            assert attempt(deployment, f"user-{n}", "guess", proxy, **forwarded)[0] == 401
        assert attempt(deployment, "bob", PASSWORDS["bob"], proxy,
                       **{"X-Forwarded-For": "198.51.100.7"})[0] == 429
        assert attempt(deployment, "bob", PASSWORDS["bob"], proxy,
                       **{"X-Forwarded-For": "198.51.100.8"})[0] == 303  # another client of the proxy
        statuses = [attempt(deployment, f"user-{n}", "guess", "127.0.4.2",  # not the proxy: not believed
                            **{"X-Forwarded-For": f"198.51.100.{n + 20}"})[0] for n in range(7)]
        assert statuses == [401] * 6 + [429]
    finally:
        deployment.console.stop()
        deployment.app.close()


def test_concurrent_attempts_cannot_pass_the_limit(deployment, users) -> None:  # type: ignore[no-untyped-def]
    visitors = [Visitor(deployment.url, f"127.0.5.{n}") for n in range(1, 11)]
    tokens = [v.login_token() for v in visitors]
    users.gate.clear()
    statuses: list[int] = []

    def post(v: Visitor, token: str) -> None:
        statuses.append(v.post("/login", {"user": "alice", "password": "guess", "csrf": token})[0])

    threads = [threading.Thread(target=post, args=pair) for pair in zip(visitors, tokens, strict=True)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(statuses) == 7 and users.inside == 3, "7 refused, 3 being checked")
    users.gate.set()
    for thread in threads:
        thread.join()
    assert sorted(statuses) == [401] * 3 + [429] * 7 and users.checked == 3


def test_password_checks_run_a_few_at_a_time_and_pages_answer_meanwhile(tmp_path: Path) -> None:
    """A flood of attempts (distinct names, distinct addresses) held only ``login_concurrency``
    threads: the pages, on the shared thread pool, kept answering."""
    users = Gated()
    deployment = start(tmp_path, authenticator=users, login_concurrency=2)
    try:
        ops = Visitor(deployment.url)
        assert ops.log_in("ops", PASSWORDS["ops"]) == 303
        visitors = [Visitor(deployment.url, f"127.0.6.{n}") for n in range(1, 13)]
        tokens = [v.login_token() for v in visitors]
        users.gate.clear()
        threads = [threading.Thread(target=v.post, args=("/login", {"user": f"user-{n}", "password": "guess",
                                                                     "csrf": token}))
                   for n, (v, token) in enumerate(zip(visitors, tokens, strict=True))]
        for thread in threads:
            thread.start()
        wait_until(lambda: users.inside == 2, "two password checks under way")
        assert ops.get("/groups")[0] == 200 and users.most == 2
        users.gate.set()
        for thread in threads:
            thread.join()
        assert users.checked == 13 and users.most == 2
    finally:
        users.gate.set()
        deployment.console.stop()
        deployment.app.close()


def test_millions_of_user_names_keep_a_bounded_table() -> None:
    clock = FakeClock()
    throttle = Throttle("user", 3, 300, 30, 900, tracked=1000, clock=clock)
    for n in range(200_000):
        key = f"user-{n}-" + "x" * 1000
        assert throttle.admit(key) == 0.0
        throttle.settle(key, False)
    assert len(throttle) == 1000
    clock.advance(301)
    throttle.admit("alice")
    assert len(throttle) == 1  # the expired went as the next key came


def test_an_attempt_refused_by_the_address_leaves_the_user_names_count_alone() -> None:
    throttle = LoginThrottle(3, 1, 300, 30, 900, 1000, FakeClock())
    assert throttle.admit("alice", "192.0.2.1") == 0.0
    throttle.settle("alice", "192.0.2.1", False)
    assert throttle.admit("alice", "192.0.2.1") == 30  # the address's single failure locked it
    for n in (2, 3):  # had the refused attempt stayed counted as under way, the second would wait
        assert throttle.admit("alice", f"192.0.2.{n}") == 0.0


def test_the_client_address_is_the_peers_unless_a_trusted_proxy_forwards_it() -> None:
    from ipaddress import ip_network

    proxies = (ip_network("10.0.0.0/8"),)
    assert client_address("192.0.2.1", "198.51.100.1", proxies) == "192.0.2.1"
    assert client_address("10.0.0.1", "203.0.113.5, 198.51.100.1, 10.0.0.2", proxies) == "198.51.100.1"
    assert client_address("10.0.0.1", "garbage, 198.51.100.1", proxies) == "198.51.100.1"
    assert client_address("10.0.0.1", "198.51.100.1, garbage", proxies) == "10.0.0.1"
    assert client_address("2001:db8::1", None, ()) == client_address("2001:db8::ffff", None, ()) == "2001:db8::/64"
    assert client_address("::ffff:192.0.2.1", None, ()) == "192.0.2.1"


def test_the_throttles_settings_are_validated() -> None:
    from broker.console.config import ConsoleConfig
    from broker.errors import BrokerConfigError
    from broker.server.config import ServerConfig

    with pytest.raises(BrokerConfigError, match="console_login_max_failures = 0"):
        ServerConfig.from_mapping({"console_port": 0, "console_login_max_failures": 0})
    with pytest.raises(BrokerConfigError, match="console_login_max_lockout = 10"):
        ConsoleConfig(login_lockout=30, login_max_lockout=10)
    with pytest.raises(BrokerConfigError, match="'proxy.example' is not an address"):
        ServerConfig.from_mapping({"console_port": 0, "console_trusted_proxies": ["proxy.example"]})
    with pytest.raises(BrokerConfigError, match="must be a list"):
        ConsoleConfig(trusted_proxies="10.0.0.1")  # type: ignore[arg-type]
    config = ServerConfig.from_mapping({"console_port": 0, "console_trusted_proxies": ["10.0.0.0/8", "::1"]})
    assert config.console is not None and config.console.trusted_proxies == ("10.0.0.0/8", "::1")
