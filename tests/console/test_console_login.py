"""The log-in over real HTTP: its CSRF token, and what a hostile client can do to it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from backends.clock import FakeClock
from broker.console.config import ConsoleConfig
from broker.console.session import LiveSessions
from broker.errors import BrokerConfigError
from broker.server.auth import Authenticator, load_users
from tests.console.deployment import PASSWORDS, USERS, Deployment, start
from tests.console.http import Visitor


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start(tmp_path_factory.mktemp("console"))
    yield deployment
    deployment.console.stop()
    deployment.app.close()


def visitor(deployment: Deployment, user: str) -> Visitor:
    v = Visitor(deployment.url)
    assert v.log_in(user, PASSWORDS[user]) == 303
    return v


def test_a_log_in_without_the_forms_csrf_token_is_refused(deployment: Deployment) -> None:
    """Login CSRF: another site's page posts the attacker's credentials from the victim's browser,
    logging the victim into the attacker's account. Only the console's own form carries the token."""
    forged = Visitor(deployment.url)  # never saw the form: no session, no token
    status, page = forged.post("/login", {"user": "alice", "password": PASSWORDS["alice"]})
    assert status == 403 and "CSRF token" in page
    assert forged.get("/groups")[0] == 303  # not logged in

    wrong = Visitor(deployment.url)
    wrong.get("/login")
    status, page = wrong.post("/login", {"user": "alice", "password": PASSWORDS["alice"], "csrf": "x" * 43})
    assert status == 403 and "CSRF token" in page
    assert wrong.get("/groups")[0] == 303

    other = Visitor(deployment.url)  # a token of another session (the attacker's own) does not do
    other.get("/login")
    status, _ = other.post("/login", {"user": "alice", "password": PASSWORDS["alice"],
                                      "csrf": Visitor(deployment.url).login_token()})
    assert status == 403


def test_the_log_in_form_carries_its_token_and_a_refused_form_a_fresh_one(deployment: Deployment) -> None:
    alice = Visitor(deployment.url)
    alice.post("/login", {"user": "alice", "password": PASSWORDS["alice"]})  # refused, but now has a form
    assert alice.log_in("alice", PASSWORDS["alice"]) == 303
    assert alice.get("/groups")[0] == 200


def test_the_session_cookie_is_httponly_strict_and_secure_when_told(deployment: Deployment, tmp_path: Path) -> None:
    """Behind a TLS proxy the cookie must not go out over plain HTTP: it had no Secure flag, and no
    setting gave it one."""
    _, headers, _ = Visitor(deployment.url).request("GET", "/login")
    flags = {part.strip().lower() for part in headers["set-cookie"].split(";")[1:]}
    assert {"httponly", "samesite=strict"} <= flags and "secure" not in flags  # plain HTTP by default
    proxied = start(tmp_path, secure_cookie=True)
    try:
        alice = Visitor(proxied.url)
        _, headers, _ = alice.request("GET", "/login")
        assert "secure" in {part.strip().lower() for part in headers["set-cookie"].split(";")[1:]}
        assert alice.log_in("alice", PASSWORDS["alice"]) == 303  # the proxy's client sends it back
        assert alice.get("/groups")[0] == 200
    finally:
        proxied.console.stop()
        proxied.app.close()
    with pytest.raises(BrokerConfigError, match="console_secure_cookie = 'yes'"):
        ConsoleConfig.from_mapping({"console_port": 0, "console_secure_cookie": "yes"})


def test_live_sessions_are_bounded_per_user_and_in_all_the_oldest_ending_first(tmp_path: Path) -> None:
    """Every log-in kept a live session until it expired: a client logging in again and again
    (one account is enough) grew the console's memory without bound."""
    deployment = start(tmp_path, max_sessions=5, max_sessions_per_user=2)
    try:
        bob, alice1, alice2 = (visitor(deployment, user) for user in ("bob", "alice", "alice"))
        alice3 = visitor(deployment, "alice")  # alice's third: her oldest ends, no one else's
        assert [v.get("/groups")[0] for v in (bob, alice1, alice2, alice3)] == [200, 303, 200, 200]
        hammering = [visitor(deployment, "alice") for _ in range(6)]  # again and again: her own end
        assert [v.get("/groups")[0] for v in (bob, alice2, alice3, *hammering)] == [200] + [303] * 6 + [200] * 2
        carol, ops1, ops2 = (visitor(deployment, user) for user in ("carol", "ops", "ops"))  # 6 in all
        live = [v.get("/groups")[0] for v in (bob, *hammering[-2:], carol, ops1, ops2)]
        assert live == [303, 200, 200, 200, 200, 200]  # the oldest of all ended
    finally:
        deployment.console.stop()
        deployment.app.close()


@pytest.mark.parametrize("step", [0.0, 3600.0, -3600.0], ids=["steady", "forward", "back"])
def test_a_session_ends_at_its_age_on_the_consoles_clock(tmp_path: Path, step: float) -> None:
    """Whichever way the wall clock steps (an NTP correction, a resumed VM), a session's age is
    measured on the monotonic clock, not the wall's."""
    clock = FakeClock()
    deployment = start(tmp_path, clock=clock, session_max_age=60)
    try:
        alice = visitor(deployment, "alice")
        clock.step(step)
        clock.advance(59)
        assert alice.get("/groups")[0] == 200
        clock.advance(2)
        assert alice.get("/groups")[0] == 303
    finally:
        deployment.console.stop()
        deployment.app.close()


def test_expired_sessions_are_dropped_not_kept() -> None:
    clock = FakeClock()
    live = LiveSessions(max_age=60, max_total=1000, max_per_user=10, clock=clock)
    for n in range(5000):  # many users' log-ins: never more than max_total kept
        live.start(f"user-{n % 500}")
    assert len(live) == 1000
    clock.advance(61)
    session = live.start("alice")  # starting a session drops every expired one
    assert len(live) == 1 and live.user_of(session) == "alice"
    clock.advance(61)
    assert live.user_of(session) is None and len(live) == 0  # an expired one asked for is dropped too


def test_a_session_id_planted_before_the_log_in_is_not_the_logged_in_one(deployment: Deployment) -> None:
    """Session fixation: an attacker gets a pre-log-in cookie of its own (the log-in form gives
    one to anyone) and plants it in the victim's browser; the victim logs in with it."""
    attacker = Visitor(deployment.url)
    attacker.login_token()
    victim = Visitor(deployment.url)
    victim.cookie = attacker.cookie  # planted
    assert victim.log_in("alice", PASSWORDS["alice"]) == 303
    assert victim.cookie != attacker.cookie and victim.get("/groups")[0] == 200
    assert attacker.get("/groups")[0] == 303  # the planted cookie logs no one in


def test_a_user_removed_or_narrowed_loses_the_pages_at_once(tmp_path: Path) -> None:
    """Rights are read from the user table on every request, not kept in the session."""
    authenticator = Authenticator(load_users(USERS))
    deployment = start(tmp_path, authenticator)
    try:
        alice, bob = visitor(deployment, "alice"), visitor(deployment, "bob")
        assert alice.get("/groups/billing/letters")[0] == 200
        authenticator.users["alice"] = replace(authenticator.users["alice"], consume=("payments",))
        assert alice.get("/groups/billing/letters")[0] == 403  # no consume on %DLQ%billing now
        del authenticator.users["bob"]
        assert bob.get("/groups")[0] == 303  # to the log-in form
    finally:
        deployment.console.stop()
        deployment.app.close()
