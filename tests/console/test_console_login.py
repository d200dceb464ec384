"""The log-in over real HTTP: its CSRF token, and what a hostile client can do to it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.console.deployment import PASSWORDS, Deployment, start
from tests.console.http import Visitor


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start(tmp_path_factory.mktemp("console"))
    yield deployment
    deployment.console.stop()
    deployment.app.close()


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
