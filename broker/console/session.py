"""Logging in with the broker's users, and the CSRF token every action must carry.

The session cookie is signed (Starlette's `SessionMiddleware`, SameSite
strict) and holds a random session id and a random CSRF token; the console
keeps the live session ids with their user, so logging out ends the session
on the server too: a copy of the cookie kept from before (a shared machine, a
proxy's log) no longer logs anyone in. The user's rights are read from the
broker's user table on every request, so a user removed or narrowed in the
settings loses them at once. With no users configured the broker is open, and
so is the console (it then refuses to bind beyond loopback, as the broker does).
"""

from __future__ import annotations

import hmac
import secrets
import threading

from starlette.requests import Request

from broker.protocol.errors import AuthenticationError
from broker.server.auth import OPEN, Authenticator, Principal
from broker.store.clock import SYSTEM_CLOCK, Clock


class Sessions:
    """Who the request's user is, from the session cookie, the live sessions and the broker's users.

    A session lives until its user logs out or ``max_age`` seconds pass; the
    live ones are kept in this process (sessions end with it, as the cookie's
    random signing key does).
    """

    def __init__(self, authenticator: Authenticator, max_age: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.authenticator, self.max_age, self.clock = authenticator, max_age, clock
        self._live: dict[str, tuple[str, float]] = {}  # session id -> (user, expiry)
        self._lock = threading.Lock()

    def principal(self, request: Request) -> Principal | None:
        """The logged-in user's rights, `OPEN` on an open broker, None when no one is logged in."""
        if not self.authenticator.required:
            return OPEN
        with self._lock:
            user, expiry = self._live.get(str(request.session.get("session", "")), ("", 0.0))
        return self.authenticator.principal(user) if expiry > self.clock.time() else None

    def log_in(self, request: Request, login: str, password: str) -> bool:
        """Check the credentials; on success start a new session (new id, new CSRF token)."""
        try:
            principal = self.authenticator.authenticate(login, password)
        except AuthenticationError:
            return False
        self.log_out(request)
        session, now = secrets.token_urlsafe(32), self.clock.time()
        with self._lock:
            self._live = {k: v for k, v in self._live.items() if v[1] > now}  # drop the expired
            self._live[session] = (principal.name, now + self.max_age)
        request.session["session"] = session
        request.session["csrf"] = secrets.token_urlsafe(32)
        return True

    def log_out(self, request: Request) -> None:
        """End the request's session here and in the cookie."""
        with self._lock:
            self._live.pop(str(request.session.get("session", "")), None)
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
