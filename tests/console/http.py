"""A cookie-keeping HTTP client over a real socket, for console tests that need no browser."""

from __future__ import annotations

import http.client
import re
from urllib.parse import urlencode, urlsplit

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


class Visitor:
    """One browser-less user of the console: keeps its session cookie, follows no redirects."""

    def __init__(self, url: str, source: str | None = None, headers: dict[str, str] | None = None) -> None:
        """``source``: the local address to connect from (any of 127.0.0.0/8 is this machine's);
        ``headers``: sent with every request."""
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.source, self.headers = source, dict(headers or {})
        self.cookie = ""

    def request(self, method: str, path: str, form: dict[str, str | list[str]] | None = None) -> tuple[int, dict[str, str], str]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30,
                                                source_address=(self.source, 0) if self.source else None)
        headers = dict(self.headers)
        if self.cookie:
            headers["Cookie"] = self.cookie
        body = None
        if form is not None:
            body = urlencode(form, doseq=True)
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            text = response.read().decode()
            found = {k.lower(): v for k, v in response.getheaders()}
        finally:
            connection.close()
        if "set-cookie" in found:
            self.cookie = found["set-cookie"].split(";", 1)[0]
        return response.status, found, text

    def get(self, path: str) -> tuple[int, str]:
        status, _, text = self.request("GET", path)
        return status, text

    def post(self, path: str, form: dict[str, str | list[str]]) -> tuple[int, str]:
        status, _, text = self.request("POST", path, form)
        return status, text

    def log_in(self, user: str, password: str) -> int:
        """Fill in the log-in form as a browser does: its CSRF token with the credentials."""
        return self.post("/login", {"user": user, "password": password, "csrf": self.login_token()})[0]

    def login_token(self) -> str:
        """The CSRF token the log-in form carries for this session."""
        _, text = self.get("/login")
        found = CSRF.search(text)
        assert found, "no CSRF token on the log-in form"
        return found.group(1)

    def csrf(self) -> str:
        """This session's CSRF token, as a page's forms carry it."""
        _, text = self.get("/groups")
        found = CSRF.search(text)
        assert found, "no CSRF token on the page"
        return found.group(1)
