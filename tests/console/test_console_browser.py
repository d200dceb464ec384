"""The console in headless Chromium (Debian's, driven by Playwright): what an operator does.

Screenshots of the main pages land in the test's own folder; ``CONSOLE_SCREENSHOTS=docs/console``
puts them where docs/console.md shows them (a run must not change the checkout unasked).
"""

from __future__ import annotations

import http.server
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backends.types import DeadLetter, Failure, Message
from broker.delivery.values import OutgoingMessage
from tests.console.deployment import PASSWORDS, Deployment, start
from tests.waiting import wait_until

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.fail("Chromium is missing: scripts/services.sh installs Debian's chromium")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where the screenshots go: ``CONSOLE_SCREENSHOTS`` (docs/console to refresh the docs' own)."""
    return Path(os.environ.get("CONSOLE_SCREENSHOTS", tmp_path))


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """A deployment of each test's own (the tests may run on different workers)."""
    deployment = start(tmp_path)
    deployment.blocked.add("p-2")
    deployment.app.publish("payments", {"payment": "p-1"})
    deployment.app.publish("payments", {"payment": "p-2", "note": "<script>alert('owned')</script>"})
    deployment.app.run(until_idle=True)
    yield deployment
    deployment.console.stop()
    deployment.app.close()


def session(browser, deployment: Deployment, user: str):  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.on("dialog", lambda dialog: pytest.fail(f"a script ran in the console: {dialog.message}"))
    page.goto(f"{deployment.url}/login")
    page.fill("input[name=user]", user)
    page.fill("input[name=password]", PASSWORDS[user])
    page.click("button[type=submit]")
    page.wait_for_url("**/topics")
    return page


def test_an_operator_finds_a_dead_letter_and_replays_it_to_its_group_only(browser, deployment, shots) -> None:  # type: ignore[no-untyped-def]
    page = session(browser, deployment, "alice")
    assert "payments" in page.inner_text("#topics")
    page.screenshot(path=str(shots / "topics.png"))

    page.click("text=Groups")
    page.click("#groups >> text=billing")
    wait_until(lambda: page.reload() and page.locator("#lag-plot").count(),  # a sample every 50 ms
               "two lag samples, which make a curve")
    assert page.locator("#lag-plot polyline").count() == 1
    page.screenshot(path=str(shots / "group.png"), full_page=True)

    page.click("#letter-sources >> text=kept by the framework")
    page.click("#letters >> a")
    assert "payment p-2 is blocked" in page.inner_text("#cause")
    assert "<script>alert('owned')</script>" in page.inner_text("#body")  # shown as text, never run
    assert page.locator("#body script").count() == 0
    page.screenshot(path=str(shots / "letter.png"), full_page=True)

    deployment.blocked.clear()
    page.click("#replay")
    assert "replay: 1 dead letter(s) of group billing" in page.inner_text("#done")
    deployment.app.run(until_idle=True)
    assert deployment.seen("charged") == ["p-1", "p-2"]
    assert deployment.seen("audited") == ["p-1", "p-2"]  # audit got p-2 once: the replay went to billing only
    assert deployment.app.dead_letters("billing") == []


def test_a_read_only_user_finds_no_action_and_a_forged_post_is_refused(browser, deployment) -> None:  # type: ignore[no-untyped-def]
    deployment.blocked.add("p-3")
    deployment.app.publish("payments", {"payment": "p-3"})
    deployment.app.run(until_idle=True)
    [letter] = [d for d in deployment.app.dead_letters("billing") if d.token == "p-3"]

    bob = session(browser, deployment, "bob")
    bob.goto(f"{deployment.url}/groups/billing")
    assert bob.locator("#letters-hidden").count() == 1
    assert bob.locator("#replay, #purge").count() == 0
    bob.goto(f"{deployment.url}/groups/billing/letters")
    assert bob.locator("#replay, #purge").count() == 0
    token = bob.locator("input[name=csrf]").first.get_attribute("value")
    forged = bob.request.post(f"{deployment.url}/groups/billing/purge",
                              form={"csrf": token or "", "source": "framework", "id": str(letter.id)})
    assert forged.status == 403

    alice = session(browser, deployment, "alice")
    no_token = alice.request.post(f"{deployment.url}/groups/billing/purge",
                                  form={"source": "framework", "id": str(letter.id)})
    assert no_token.status == 403
    assert letter.id in [d.id for d in deployment.app.dead_letters("billing")]


def test_ten_thousand_dead_letters_open_paged(browser, deployment, shots) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    before = deployment.app.dead_letter_queue.count("billing")
    with deployment.app.store.transaction() as tx:
        for n in range(10_000):
            message = Message(f"bulk-{n}", "payments", 0, n, b'{"payment": "bulk-%d"}' % n)
            tx.add_dead_letter(DeadLetter("billing", message, f"bulk-{n}",
                                          Failure("builtins.ValueError", f"bulk {n}", "", 1, now, now)))
    page = session(browser, deployment, "alice")
    started = time.perf_counter()
    page.goto(f"{deployment.url}/groups/billing/letters")
    first = time.perf_counter() - started
    assert f"{before + 10_000} dead letter(s)" in page.inner_text("#letter-total")
    assert page.locator("#letters tbody tr").count() == 50
    started = time.perf_counter()
    page.click("#next-page")
    second = time.perf_counter() - started
    assert page.locator("#letters tbody tr").count() == 50
    page.screenshot(path=str(shots / "letters.png"))
    print(f"\n{before + 10_000:,} dead letters: first page {first * 1000:.0f} ms, next page {second * 1000:.0f} ms")


def test_one_of_two_broker_dead_letters_is_replayed_to_its_group_and_the_other_stays(browser, deployment) -> None:  # type: ignore[no-untyped-def]
    """The broker's ``%DLQ%ledger`` (a program on the broker directly): choose one letter, replay
    it; it reaches group ``ledger`` only (``ledger-audit`` reads the topic too), the other stays."""
    api = deployment.app.transport.api
    api.publish("ledger", [OutgoingMessage(b'{"entry": "l-1"}'), OutgoingMessage(b'{"entry": "l-2"}')])
    audit = api.join("ledger-audit", ["ledger"])
    api.ack(audit, [d.receipt for d in fetch(api, audit, 2)])
    api.leave(audit)
    member = api.join("ledger", ["ledger"])
    api.dead_letter(member, [d.receipt for d in fetch(api, member, 2)], "no such account")
    api.leave(member)

    ops = session(browser, deployment, "ops")
    ops.goto(f"{deployment.url}/groups/ledger/letters?source=broker")
    assert "2 dead letter(s)" in ops.inner_text("#letter-total")
    first = ops.locator("#letters tbody tr", has_text="l-1")
    assert "no such account" in first.inner_text()
    first.locator("input[type=checkbox]").check()
    ops.click("#replay")
    assert "replay: 1 dead letter(s) of group ledger" in ops.inner_text("#done")

    ops.goto(f"{deployment.url}/groups/ledger/letters?source=broker")
    assert "1 dead letter(s)" in ops.inner_text("#letter-total")
    assert "l-2" in ops.inner_text("#letters") and "l-1" not in ops.inner_text("#letters")
    member = api.join("ledger", ["ledger"])
    assert [d.body for d in fetch(api, member, 1)] == [b'{"entry": "l-1"}']
    api.ack(member, [])
    api.leave(member)
    audit = api.join("ledger-audit", ["ledger"])
    assert api.fetch(audit, 10, 0.5) == []  # the replay went to the failing group only
    api.leave(audit)

    alice = session(browser, deployment, "alice")  # no right on group ledger
    token = alice.locator("input[name=csrf]").first.get_attribute("value")
    refused = alice.request.post(f"{deployment.url}/groups/ledger/purge",
                                 form={"csrf": token or "", "source": "broker", "id": "1"})
    assert refused.status == 403
    ops.locator("#letters tbody tr", has_text="l-2").locator("input[type=checkbox]").check()
    ops.click("#purge")
    assert "purge: 1 dead letter(s) of group ledger" in ops.inner_text("#done")
    ops.goto(f"{deployment.url}/groups/ledger/letters?source=broker")
    assert "0 dead letter(s)" in ops.inner_text("#letter-total")


def fetch(api, member: str, count: int) -> list:  # type: ignore[no-untyped-def,type-arg]
    got: list = []  # type: ignore[type-arg]
    while len(got) < count:
        batch = api.fetch(member, count - len(got), 5.0)
        assert batch, f"expected {count} messages, got {len(got)}"
        got += batch
    return got


@pytest.fixture
def attacker() -> Iterator[Callable[[str], str]]:
    """Another site on this machine (127.0.0.1, another port: the same *site* as the console, so
    even a SameSite=strict cookie goes with its requests): serves the page given, returns its URL."""
    pages: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            body = pages.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def serve(html: str) -> str:
        path = f"/{len(pages)}.html"
        pages[path] = html.encode()
        return f"http://127.0.0.1:{server.server_address[1]}{path}"

    yield serve
    server.shutdown()
    server.server_close()
    thread.join()


def forged_form(action: str, fields: dict[str, str]) -> str:
    inputs = "".join(f'<input type="hidden" name="{k}" value="{v}">' for k, v in fields.items())
    return f'<body onload="document.forms[0].submit()"><form method="post" action="{action}">{inputs}</form></body>'


def test_another_sites_forms_reach_the_console_with_the_cookie_and_change_nothing(browser, deployment, attacker) -> None:  # type: ignore[no-untyped-def]
    """A page on another port of the same host is the same site: the browser sends alice's
    session cookie with its auto-submitted forms. Only the CSRF token, which that page cannot
    read, stops them: a purge, a log-out and a log-in into carol's account (login CSRF)."""
    [letter] = deployment.app.dead_letters("billing")
    alice = session(browser, deployment, "alice")
    for action, fields in (("/groups/billing/purge", {"source": "framework", "id": str(letter.id)}),
                           ("/logout", {}),
                           ("/login", {"user": "carol", "password": PASSWORDS["carol"]})):
        with alice.expect_response(lambda r, a=action: r.url.endswith(a) and r.request.method == "POST") as sent:
            alice.goto(attacker(forged_form(deployment.url + action, {**fields, "csrf": "guessed"})))
        assert sent.value.status == 403, action
        alice.wait_for_url(deployment.url + action)  # the forged form's page, loaded
        if action != "/login":  # the forged request came as alice: her session's cookie went with it
            assert alice.inner_text("#user") == "alice"
    assert [d.id for d in deployment.app.dead_letters("billing")] == [letter.id]
    alice.goto(f"{deployment.url}/groups")
    assert alice.inner_text("#user") == "alice"  # still logged in, and as herself
