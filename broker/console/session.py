"""Logging in with the broker's users, and the CSRF token every action must carry.

The session cookie is signed (Starlette's `SessionMiddleware`, SameSite
strict) and holds a random session id and a random CSRF token; the console
keeps the live session ids with their user, so logging out ends the session
on the server too: a copy of the cookie kept from before (a shared machine, a
proxy's log) no longer logs anyone in. The user's rights are read from the
broker's user table on every request, so a user removed or narrowed in the
settings loses them at once. With no users configured the broker is open, and
so is the console (it then refuses to bind beyond loopback, as the broker does).

The live sessions are bounded: the expired are dropped as new ones start, and
past ``max_sessions`` in all, or ``max_sessions_per_user`` for one user, the
oldest ends first, so logging in again and again cannot grow the console's
memory, and one account logging in again and again ends only its own sessions.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict

import structlog
from starlette.requests import Request

from broker.protocol.errors import AuthenticationError
from broker.server.auth import OPEN, Authenticator, Principal
from broker.store.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger("broker.console")


class LiveSessions:
    """The live session ids with their user, oldest first, bounded in number.

    Every session lives ``max_age`` seconds, so the oldest is the first to
    expire: starting a session drops the expired ones from the front, then, at
    a bound, the oldest of the user's own (``max_per_user``) or of all
    (``max_total``).
    """

    def __init__(self, max_age: float, max_total: int, max_per_user: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self.max_age, self.max_total, self.max_per_user, self.clock = max_age, max_total, max_per_user, clock
        self._live: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session id -> (user, expiry)
        self._of_user: dict[str, OrderedDict[str, None]] = {}  # user -> their session ids, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def start(self, user: str) -> str:
        """A new session id for ``user``, live for ``max_age`` seconds."""
        session, now = secrets.token_urlsafe(32), self.clock.monotonic()
        with self._lock:
            while self._live and next(iter(self._live.values()))[1] <= now:
                self._end(next(iter(self._live)))
            while len(self._of_user.get(user, ())) >= self.max_per_user:
                self._end(next(iter(self._of_user[user])), "console_max_sessions_per_user")
            while len(self._live) >= self.max_total:
                self._end(next(iter(self._live)), "console_max_sessions")
            self._live[session] = (user, now + self.max_age)
            self._of_user.setdefault(user, OrderedDict())[session] = None
        return session

    def user_of(self, session: str) -> str | None:
        """Whose live session ``session`` is (None: none, or expired, and then dropped)."""
        with self._lock:
            user, expiry = self._live.get(session, ("", 0.0))
            if expiry > self.clock.monotonic():
                return user
            self._end(session)
            return None

    def end(self, session: str) -> None:
        with self._lock:
            self._end(session)

    def _end(self, session: str, bound: str | None = None) -> None:
        user, _ = self._live.pop(session, ("", 0.0))
        mine = self._of_user.get(user)
        if mine is not None:
            mine.pop(session, None)
            if not mine:
                del self._of_user[user]
        if bound is not None:
            log.info("console.session_ended", user=user, reason=f"{bound} reached")


class Sessions:
    """Who the request's user is, from the session cookie, the live sessions and the broker's users.

    A session lives until its user logs out, ``max_age`` seconds pass or the
    bounds of `LiveSessions` end it; the live ones are kept in this process
    (sessions end with it, as the cookie's random signing key does).
    """

    def __init__(self, authenticator: Authenticator, max_age: float, max_sessions: int = 1000,
                 max_sessions_per_user: int = 10, clock: Clock = SYSTEM_CLOCK) -> None:
        self.authenticator = authenticator
        self.live = LiveSessions(max_age, max_sessions, max_sessions_per_user, clock)

    def principal(self, request: Request) -> Principal | None:
        """The logged-in user's rights, `OPEN` on an open broker, None when no one is logged in."""
        if not self.authenticator.required:
            return OPEN
        user = self.live.user_of(str(request.session.get("session", "")))
        return None if user is None else self.authenticator.principal(user)

    def log_in(self, request: Request, login: str, password: str) -> bool:
        """Check the credentials; on success start a new session (new id, new CSRF token)."""
        try:
            principal = self.authenticator.authenticate(login, password)
        except AuthenticationError:
            return False
        self.log_out(request)
        request.session["session"] = self.live.start(principal.name)
        request.session["csrf"] = secrets.token_urlsafe(32)
        return True

    def log_out(self, request: Request) -> None:
        """End the request's session here and in the cookie."""
        self.live.end(str(request.session.get("session", "")))
        request.session.clear()

    @staticmethod
    def csrf_token(request: Request) -> str:
        """The session's CSRF token (made on first use: an open console has no login step)."""
        token = request.session.get("csrf")
        if not token:
            token = request.session["csrf"] = secrets.token_urlsafe(32)
        return str(token)

    @staticmethod
    def csrf_ok(request: Request, sent: object) -> bool:
        token = request.session.get("csrf")
        return bool(token) and isinstance(sent, str) and hmac.compare_digest(sent, str(token))
