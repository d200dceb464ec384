"""The console over real HTTP: log-in, the native protocol's rights on every page and action, CSRF."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.types import DeadLetter, Failure, Message, text_from_bytes
from broker.console.config import ConsoleConfig
from broker.errors import BrokerConfigError
from broker.server.auth import Authenticator, Principal, load_users
from broker.server.config import ServerConfig
from tests.console.deployment import PASSWORDS, USERS, Deployment, start
from tests.console.http import Visitor


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start(tmp_path_factory.mktemp("console"))
    deployment.blocked.update({"p-2", "p-3"})
    for payment in ("p-1", "p-2", "p-3"):
        deployment.app.publish("payments", {"payment": payment, "note": "<b>bold</b>"})
    deployment.app.run(until_idle=True)
    yield deployment
    deployment.console.stop()
    deployment.app.close()


def visitor(deployment: Deployment, user: str | None) -> Visitor:
    v = Visitor(deployment.url)
    if user is not None:
        assert v.log_in(user, PASSWORDS[user]) == 303
    return v


def test_every_page_needs_a_login(deployment: Deployment) -> None:
    anonymous = visitor(deployment, None)
    for path in ("/topics", "/groups", "/groups/billing", "/groups/billing/letters", "/letters/1", "/lookup"):
        status, headers, _ = anonymous.request("GET", path)
        assert (status, headers["location"]) == (303, "/login"), path
    assert anonymous.post("/groups/billing/replay", {"source": "framework", "id": "1"})[0] == 303
    assert anonymous.log_in("alice", "wrong") == 401


def test_logging_out_ends_the_session_for_a_kept_copy_of_its_cookie(deployment: Deployment) -> None:
    """A cookie copied before the log-out (a shared machine, a proxy's log) logs no one in after it."""
    alice = visitor(deployment, "alice")
    token, kept = alice.csrf(), alice.cookie
    assert alice.post("/logout", {"csrf": token})[0] == 303
    thief = Visitor(deployment.url)
    thief.cookie = kept
    status, headers, _ = thief.request("GET", "/groups")
    assert (status, headers["location"]) == (303, "/login")
    before = [letter.id for letter in deployment.app.dead_letters("billing")]
    form = {"source": "framework", "id": [str(i) for i in before], "csrf": token}
    assert thief.post("/groups/billing/purge", form)[0] == 303
    assert [letter.id for letter in deployment.app.dead_letters("billing")] == before
    assert visitor(deployment, "alice").get("/groups")[0] == 200  # a new log-in is a new session


def test_pages_forbid_scripts_and_framing(deployment: Deployment) -> None:
    _, headers, _ = visitor(deployment, "alice").request("GET", "/groups")
    assert "default-src 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"


def test_a_letter_id_that_is_no_number_is_not_found(deployment: Deployment) -> None:
    """Starlette's int converter raised on 5000 digits (Python's limit on int strings) while routing,
    before any log-in: a 500 and a traceback in the log for each such request from anyone."""
    alice = visitor(deployment, "alice")
    for letter in ("9" * 5000, "9" * 30, "-1", "1e3", "%D9%A3"):  # the last: an Arabic-Indic 3
        assert alice.get(f"/letters/{letter}")[0] == 404, letter[:10]
    status, headers, _ = visitor(deployment, None).request("GET", "/letters/" + "9" * 5000)
    assert (status, headers["location"]) == (303, "/login")


def test_a_page_of_dead_letters_is_not_kept_in_the_browsers_cache(deployment: Deployment) -> None:
    """Without no-store a browser keeps the page on disk and shows it with Back after the log-out."""
    alice = visitor(deployment, "alice")
    letter = deployment.app.dead_letters("billing")[0]
    for path in ("/groups/billing/letters", f"/letters/{letter.id}", "/login"):
        status, headers, _ = alice.request("GET", path)
        assert status == 200 and headers["cache-control"] == "no-store", path


def test_listings_show_only_what_the_native_protocol_would(deployment: Deployment) -> None:
    alice, carol = visitor(deployment, "alice"), visitor(deployment, "carol")
    assert "payments" in alice.get("/topics")[1]
    assert "billing" in alice.get("/groups")[1]
    assert "audit" not in alice.get("/groups")[1]  # a group alice has no right on
    assert "payments" not in carol.get("/topics")[1]
    assert "billing" not in carol.get("/groups")[1]
    assert carol.get("/groups/billing")[0] == 403
    assert carol.get("/groups/billing/letters")[0] == 403


def test_a_user_with_the_group_right_alone_sees_lag_but_no_dead_letters(deployment: Deployment) -> None:
    bob = visitor(deployment, "bob")
    status, page = bob.get("/groups/billing")
    assert status == 200 and 'id="lag"' in page and 'id="letters-hidden"' in page
    assert bob.get("/groups/billing/letters")[0] == 403
    letter = deployment.app.dead_letters("billing")[0]
    assert bob.get(f"/letters/{letter.id}")[0] == 404


def test_a_forged_or_unauthorised_action_changes_nothing(deployment: Deployment) -> None:
    before = [letter.id for letter in deployment.app.dead_letters("billing")]
    assert len(before) == 2
    alice, bob = visitor(deployment, "alice"), visitor(deployment, "bob")
    form = {"source": "framework", "id": [str(i) for i in before]}
    assert alice.post("/groups/billing/purge", form)[0] == 403  # no CSRF token: a forged request
    assert alice.post("/groups/billing/purge", {**form, "csrf": "x" * 43})[0] == 403
    assert bob.post("/groups/billing/purge", {**form, "csrf": bob.csrf()})[0] == 403  # his token, no right
    assert alice.post("/groups/audit/purge", {**form, "csrf": alice.csrf()})[0] == 403  # not her group
    assert [letter.id for letter in deployment.app.dead_letters("billing")] == before


def test_a_body_is_escaped(deployment: Deployment) -> None:
    letter = deployment.app.dead_letters("billing")[0]
    status, page = visitor(deployment, "alice").get(f"/letters/{letter.id}")
    assert status == 200
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold</b>" not in page


def test_the_outbox_backlog_is_shown_to_admins(deployment: Deployment) -> None:
    with deployment.app.store.transaction() as tx:  # written, not relayed: no worker runs now
        tx.publish("invoices", {"payment": "p-1"})
    status, page = visitor(deployment, "ops").get("/outbox")
    assert status == 200 and "pending</th><td>1<" in page.replace(" ", "").replace("\n", "")
    alice = visitor(deployment, "alice")
    assert alice.get("/outbox")[0] == 404
    assert 'href="/outbox"' not in alice.get("/groups")[1]


def test_the_handlers_counters_are_read_from_the_workers_metrics(tmp_path: Path) -> None:
    """A worker's /metrics (here this process's, where the handlers ran) feeds the Handlers page."""
    from prometheus_client import start_http_server

    from broker.console.serving import start_console
    from reliable.console import WorkerCounters

    deployment = start(tmp_path)
    deployment.blocked.add("p-9")
    deployment.app.publish("payments", {"payment": "p-9"})
    deployment.app.run(until_idle=True)
    server, thread = start_http_server(0, addr="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        counters = WorkerCounters([url, "http://127.0.0.1:9/metrics"], timeout=1.0)
        console = start_console(ConsoleConfig(port=0), Authenticator(load_users(USERS)), None,
                                counters=counters)
        try:
            ops, alice = Visitor(console.url), Visitor(console.url)
            ops.log_in("ops", PASSWORDS["ops"])
            alice.log_in("alice", PASSWORDS["alice"])
            status, page = ops.get("/handlers")
            assert status == 200
            assert "<td>charge</td>" in page and "dead_lettered" in page and "(no answer)" in page
            assert alice.get("/handlers")[0] == 404
        finally:
            console.stop()
    finally:
        server.shutdown()
        thread.join()
        deployment.console.stop()
        deployment.app.close()


def test_console_settings_are_validated() -> None:
    with pytest.raises(BrokerConfigError, match="console_prot"):
        ServerConfig.from_mapping({"console_prot": 8700})
    with pytest.raises(BrokerConfigError, match="without broker.console_port"):
        ServerConfig.from_mapping({"console_page_size": 10})
    with pytest.raises(BrokerConfigError, match="console_port = 70000"):
        ServerConfig.from_mapping({"console_port": 70000})
    with pytest.raises(BrokerConfigError, match="console_sample_interval"):
        ConsoleConfig(sample_interval="often")  # type: ignore[arg-type]
    with pytest.raises(BrokerConfigError, match="console_max_sessions = 0"):
        ServerConfig.from_mapping({"console_port": 0, "console_max_sessions": 0})
    with pytest.raises(BrokerConfigError, match="console_max_sessions_per_user"):
        ConsoleConfig(max_sessions_per_user=2.5)  # type: ignore[arg-type]
    assert ServerConfig.from_mapping({}).console is None
    assert ServerConfig.from_mapping({"console_port": 0}).console == ConsoleConfig(port=0)


def test_an_open_console_binds_loopback_only(tmp_path: Path) -> None:
    from broker.console.serving import start_console
    from broker.server.auth import Authenticator

    with pytest.raises(BrokerConfigError, match="may only bind a loopback"):
        start_console(ConsoleConfig(host="0.0.0.0", port=0), Authenticator(), None)


def test_an_open_console_answers_only_to_loopback_names() -> None:
    """With no users the console is open and trusts its loopback binding; a page of another site
    whose name was rebound to 127.0.0.1 (DNS rebinding) could read it, CSRF token included."""
    from broker.console.serving import start_console

    console = start_console(ConsoleConfig(port=0), Authenticator(), None)

    def status(host: str) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", console.port, timeout=30)
        try:
            connection.request("GET", "/groups", headers={"Host": host})
            return connection.getresponse().status
        finally:
            connection.close()

    try:
        assert [status(f"{name}:{console.port}") for name in ("127.0.0.1", "localhost")] == [200, 200]
        assert status(f"evil.example:{console.port}") == 400
    finally:
        console.stop()


def test_a_message_is_looked_up_by_key(deployment: Deployment) -> None:
    deployment.app.publish("receipts", {"receipt": "<i>r-7</i>"}, key="r-7")  # no handler reads receipts
    status, page = visitor(deployment, "ops").get("/lookup?topic=receipts&key=r-7")
    assert status == 200, page
    assert "&lt;i&gt;r-7&lt;/i&gt;" in page
    assert visitor(deployment, "alice").get("/lookup?topic=receipts&key=r-7")[0] == 403  # no consume right


def test_a_message_id_that_is_not_kept_is_not_found_for_an_admin_too(deployment: Deployment) -> None:
    """An admin sees every message, so nothing filtered out the None of a lookup that found none:
    the page failed on it (a 500)."""
    for user in ("ops", "alice"):
        status, page = visitor(deployment, user).get("/lookup?id=no-such-message")
        assert status == 200 and "Nothing found that you may see." in page, user


def test_a_password_is_checked_off_the_event_loop(tmp_path: Path) -> None:
    """scrypt takes tens of milliseconds of CPU: on the console's event loop every other request
    waited behind each log-in attempt, so a client guessing passwords slowed every page."""
    checked_on: list[threading.Thread] = []

    class Recording(Authenticator):
        def authenticate(self, login: str | None, password: str | None) -> Principal:
            checked_on.append(threading.current_thread())
            return super().authenticate(login, password)

    deployment = start(tmp_path, authenticator=Recording(load_users(USERS)))
    try:
        assert Visitor(deployment.url).log_in("alice", PASSWORDS["alice"]) == 303
        assert Visitor(deployment.url).log_in("alice", "wrong") == 401
        assert len(checked_on) == 2 and deployment.console.thread not in checked_on
    finally:
        deployment.console.stop()
        deployment.app.close()


def test_a_binary_key_and_header_are_shown_as_escapes(tmp_path: Path) -> None:
    """A Kafka key or header value that is not UTF-8 (`text_from_bytes`) cannot be encoded into a
    page: it is shown \\xNN, where it made the page a 500 before."""
    deployment = start(tmp_path)
    try:
        raw = text_from_bytes(b"k\x80\xff")
        message = Message(id="m-1", topic="payments", queue=0, offset=0, payload=b"{}", key=raw, headers={"h": raw})
        with deployment.app.store.transaction() as tx:
            letter_id = tx.add_dead_letter(DeadLetter("billing", message, None, Failure("E", "e", "t", 1, 1.0, 2.0)))
        status, page = visitor(deployment, "alice").get(f"/letters/{letter_id}")
        assert status == 200
        assert page.count("k\\x80\\xff") == 2  # the key and the header
    finally:
        deployment.console.stop()
        deployment.app.close()
