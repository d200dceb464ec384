"""Logging in with the broker's users, and the CSRF token every action must carry.

The session is a signed cookie (Starlette's `SessionMiddleware`, SameSite
strict) holding the user's name and a random CSRF token; the user's rights are
read from the broker's user table on every request, so a user removed or
narrowed in the settings loses them at once. With no users configured the
broker is open, and so is the console (it then refuses to bind beyond
loopback, as the broker does).
"""

from __future__ import annotations

import hmac
import secrets

from starlette.requests import Request

from broker.protocol.errors import AuthenticationError
from broker.server.auth import OPEN, Authenticator, Principal


class Sessions:
    """Who the request's user is, from the session cookie and the broker's users."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    def principal(self, request: Request) -> Principal | None:
        """The logged-in user's rights, `OPEN` on an open broker, None when no one is logged in."""
        if not self.authenticator.required:
            return OPEN
        return self.authenticator.principal(str(request.session.get("user", "")))

    def log_in(self, request: Request, login: str, password: str) -> bool:
        try:
            principal = self.authenticator.authenticate(login, password)
        except AuthenticationError:
            return False
        request.session.clear()
        request.session["user"] = principal.name
        request.session["csrf"] = secrets.token_urlsafe(32)
        return True

    @staticmethod
    def log_out(request: Request) -> None:
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
