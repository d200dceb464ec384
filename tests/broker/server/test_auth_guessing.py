"""Password guessing against both listeners, with real clients from distinct client addresses (any
of 127.0.0.0/8 is this machine's): what a guessing client gets, and what everyone else still gets.

The server runs in this process, on a thread of its own, with a fake clock for its lock-outs; the
password checks are counted by wrapping the real `Authenticator.authenticate` (scrypt still runs).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import stomp
from stomp.exception import ConnectFailedException
from structlog.testing import capture_logs

from broker.protocol import codec as native_codec
from broker.protocol.codec import FrameDecoder, decode_body
from broker.protocol.errors import AuthenticationError, LockedOutError
from broker.server.auth import Authenticator, Principal
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.broker.server.threaded import ClientFrom, native
from tests.passwords import hash_password
from tests.waiting import wait_until

PASSWORD = "s3cret"
USERS = {"app": {"password_hash": hash_password(PASSWORD), "admin": True}}
LOCKED = "too many failed authentications from"


class Checks:
    """Counts the password checks the server makes, and how many ran at once at most."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made = self.inside = self.most = 0


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Checks:
    counted, real = Checks(), Authenticator.authenticate

    def authenticate(self: Authenticator, login: str | None, password: str | None) -> Principal:
        with counted.lock:
            counted.made, counted.inside = counted.made + 1, counted.inside + 1
            counted.most = max(counted.most, counted.inside)
        try:
            return real(self, login, password)
        finally:
            with counted.lock:
                counted.inside -= 1

    monkeypatch.setattr(Authenticator, "authenticate", authenticate)
    return counted


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@contextmanager
def serving(tmp_path: Path, clock: FakeClock, **limits: Any) -> Iterator[BrokerServer]:
    """A server with user ``app`` on free native and STOMP ports, its loop on a thread of its own."""
    with threaded.serving(tmp_path, clock, USERS, **limits) as server:
        yield server


def log_in(server: BrokerServer, source: str, password: str) -> tuple[float, str]:
    """Seconds until the server answered a native ``hello`` from ``source``, and its refusal ('' if none)."""
    client, began = ClientFrom(native(server), source, user="app", password=password), time.monotonic()
    try:
        client.topics()
        return time.monotonic() - began, ""
    except AuthenticationError as error:
        return time.monotonic() - began, str(error)
    finally:
        client.close()


def stomp_connect(server: BrokerServer, source: str, password: str) -> tuple[float, str]:
    """`log_in` with stomp.py's CONNECT: the seconds until answered and the ERROR's message."""
    connection = stomp.Connection12([("127.0.0.1", server.port("stomp"))], bind_host_port=(source, 0),
                                    reconnect_attempts_max=1)
    errors: list[str] = []
    connection.set_listener("errors", type("Errors", (stomp.ConnectionListener,), {
        "on_error": lambda self, frame: errors.append(frame.headers.get("message", ""))})())
    began = time.monotonic()
    try:
        connection.connect("app", password, wait=True)
    except ConnectFailedException:
        return time.monotonic() - began, wait_until(lambda: errors, "the ERROR frame")[0]
    connection.disconnect()
    return time.monotonic() - began, ""


@pytest.mark.parametrize("attempt", [log_in, stomp_connect], ids=["native", "stomp"])
def test_a_failed_authentication_is_answered_only_after_the_delay(
        tmp_path, clock, checks, attempt: Callable[[BrokerServer, str, str], tuple[float, str]]) -> None:
    with serving(tmp_path, clock, auth_failure_delay=0.3) as server:
        guesses = [attempt(server, "127.0.0.2", f"guess{n}") for n in range(4)]
        assert all(seconds >= 0.3 and "wrong user name or password" in refusal for seconds, refusal in guesses)
        assert attempt(server, "127.0.0.2", PASSWORD)[1] == ""
        assert checks.made == 5 and server.metrics.totals()["auth_failures"] == 4


@pytest.mark.parametrize("attempt", [log_in, stomp_connect], ids=["native", "stomp"])
def test_a_guessing_loop_is_answered_late_then_locked_out_while_others_log_in(
        tmp_path, clock, checks, attempt: Callable[[BrokerServer, str, str], tuple[float, str]]) -> None:
    with serving(tmp_path, clock, auth_failure_delay=0.3, auth_max_failures=4) as server, capture_logs() as logs:
        guesses = [attempt(server, "127.0.0.2", f"guess{n}") for n in range(7)]
        assert all(seconds >= 0.3 for seconds, _ in guesses)  # no refusal comes before the delay
        assert all("wrong user name or password" in refusal for _, refusal in guesses[:4])
        assert all(LOCKED in refusal and "127.0.0.2" in refusal for _, refusal in guesses[4:])
        seconds, refusal = attempt(server, "127.0.0.2", PASSWORD)  # the right password too
        assert seconds >= 0.3 and "refused for 30 s more" in refusal
        assert checks.made == 4  # a locked address's attempts are refused before any check
        assert attempt(server, "127.0.0.3", PASSWORD)[1] == ""  # other addresses are not affected
        assert attempt(server, "127.0.0.1", PASSWORD)[1] == ""
        totals = server.metrics.totals()
        assert (totals["auth_failures"], totals["auth_refused"], totals["auth_lockouts"]) == (4, 4, 1)
    locked = [e for e in logs if e["event"] == "authentication_locked_out"]
    refused = [e for e in logs if e["event"] == "authentication_refused"]
    assert [(e["address"], e["seconds"]) for e in locked] == [("127.0.0.2", 30.0)]
    assert len(refused) == 4 and {e["address"] for e in refused} == {"127.0.0.2"}


def test_a_lock_out_ends_after_its_time_and_doubles_with_each_further_failure(tmp_path, clock, checks) -> None:
    with serving(tmp_path, clock, auth_failure_delay=0, auth_max_failures=3, auth_lockout=30,
                 auth_max_lockout=100) as server:
        assert [LOCKED in log_in(server, "127.0.0.2", "guess")[1] for _ in range(4)] == [False] * 3 + [True]
        clock.advance(29.5)
        assert LOCKED in log_in(server, "127.0.0.2", PASSWORD)[1]
        clock.advance(0.5)
        assert log_in(server, "127.0.0.2", PASSWORD)[1] == ""  # the lock-out is over
        for lockout in (60, 100, 100):  # a success did not forget the failures: one more locks again
            assert "wrong user name" in log_in(server, "127.0.0.2", "guess")[1]
            assert f"refused for {lockout} s more" in log_in(server, "127.0.0.2", PASSWORD)[1]
            clock.advance(lockout)
        assert checks.made == 3 + 1 + 3


def test_password_checks_run_a_few_at_once_and_a_flood_from_one_address_waits_its_turn(
        tmp_path, clock, checks) -> None:
    """Sixty guesses at once from one address (never locked here): two checks run at a time, and a
    client from another address is answered while most of the flood still waits."""
    with serving(tmp_path, clock, auth_failure_delay=0, auth_max_failures=1000, auth_concurrency=2) as server:
        connected = ClientFrom(native(server), "127.0.0.4", user="app", password=PASSWORD)
        connected.topics()
        with ThreadPoolExecutor(60) as pool:
            flood = [pool.submit(log_in, server, "127.0.0.2", f"guess{n}") for n in range(60)]
            wait_until(lambda: checks.made >= 4, "the flood's checks to be under way")
            assert log_in(server, "127.0.0.3", PASSWORD)[1] == ""
            answered = sum(attempt.done() for attempt in flood)
            connected.topics()  # a connected client is served meanwhile, not behind the flood
            waiting = sum(not attempt.done() for attempt in flood)
            assert all("wrong user name" in attempt.result()[1] for attempt in flood)
        connected.close()
    assert answered < 30, f"the other address's log-in waited for {answered} of the flood's checks"
    assert checks.most == 2
    assert waiting > 0, "the connected client was served only after the whole flood's checks"


def test_the_addresses_remembered_are_bounded(tmp_path, clock) -> None:
    """Failures without a password cost no check, so many addresses fail fast; only the most recent
    ``auth_tracked`` are kept."""
    with serving(tmp_path, clock, auth_failure_delay=0, auth_tracked=100) as server:
        sources = [f"127.0.{n // 250 + 10}.{n % 250 + 1}" for n in range(300)]
        for source in sources:
            client = ClientFrom(native(server), source, user="app", password=None)
            with pytest.raises(AuthenticationError, match="credentials are required"):
                client.topics()
            client.close()
        assert len(server.guard.addresses) == 100


def test_a_shared_address_is_never_locked_out_only_delayed(tmp_path, clock) -> None:
    """Locking a load balancer's address would lock out every client behind it."""
    with serving(tmp_path, clock, auth_failure_delay=0.2, auth_max_failures=2,
                 auth_shared_addresses=["127.0.0.2/31"]) as server:
        guesses = [log_in(server, "127.0.0.3", "guess") for _ in range(4)]
        assert all(seconds >= 0.2 and "wrong user name" in refusal for seconds, refusal in guesses)
        assert log_in(server, "127.0.0.3", PASSWORD)[1] == ""
        assert LOCKED in [log_in(server, "127.0.0.4", "guess") for _ in range(3)][-1][1]  # not shared


def test_a_locked_out_address_is_told_so_with_a_code_of_its_own_and_the_seconds_left(
        tmp_path, clock, checks) -> None:
    """``locked_out``, not the ``unauthenticated`` of a wrong password: a client can tell "wait" from
    "your credentials are wrong". `LockedOutError` is an `AuthenticationError`, so code that caught
    the refusal before catches it still."""
    with serving(tmp_path, clock, auth_failure_delay=0, auth_max_failures=2, auth_lockout=30) as server:
        assert all("wrong user name" in log_in(server, "127.0.0.2", "guess")[1] for _ in range(2))
        clock.advance(10)
        client = ClientFrom(native(server), "127.0.0.2", user="app", password=PASSWORD)
        with pytest.raises(LockedOutError, match="refused for 20 s more") as refused:
            client.topics()
        client.close()
        assert refused.value.code == "locked_out" and refused.value.retry_after == 20.0
        assert isinstance(refused.value, AuthenticationError)
        with socket.create_connection(("127.0.0.1", server.port("native")), 30, ("127.0.0.2", 0)) as sock:
            sock.sendall(native_codec.encode({"id": 1, "op": "hello", "user": "app", "password": PASSWORD}))
            [frame] = FrameDecoder(1 << 20).feed(sock.recv(65536))
        reply = decode_body(frame)
        assert (reply["ok"], reply["fatal"], reply["error"]["code"], reply["error"]["retry_after"]) == (
            False, True, "locked_out", 20.0)
        connection = stomp.Connection12([("127.0.0.1", server.port("stomp"))], bind_host_port=("127.0.0.2", 0),
                                        reconnect_attempts_max=1)
        errors: list[dict[str, str]] = []
        connection.set_listener("errors", type("Errors", (stomp.ConnectionListener,), {
            "on_error": lambda self, frame: errors.append(frame.headers)})())
        with pytest.raises(ConnectFailedException):
            connection.connect("app", PASSWORD, wait=True)
        headers = wait_until(lambda: errors, "the ERROR frame")[0]
        assert headers["message"].startswith("locked_out: too many failed authentications from 127.0.0.2: "
                                             "refused for 20 s more")
        assert headers["retry-after"] == "20"
        assert checks.made == 2  # none of the refused attempts was checked


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["forward", "back"])
def test_a_lock_out_lasts_its_time_whichever_way_the_wall_clock_steps(tmp_path, clock, checks, step) -> None:
    """A lock-out is timed by the monotonic clock: an NTP step or a resumed VM neither lifts it at
    once nor stretches it by the step."""
    with serving(tmp_path, clock, auth_failure_delay=0, auth_max_failures=3, auth_lockout=30) as server:
        assert [LOCKED in log_in(server, "127.0.0.2", "guess")[1] for _ in range(4)] == [False] * 3 + [True]
        clock.step(step)
        clock.advance(29.5)
        assert LOCKED in log_in(server, "127.0.0.2", PASSWORD)[1]
        clock.advance(0.5)
        assert log_in(server, "127.0.0.2", PASSWORD)[1] == ""
