"""The console's pages and actions (Starlette, Jinja2 templates with autoescape, no script).

Every handler first asks `Sessions` who the user is and `access` what that user
may see; an action (POST) also needs the session's CSRF token and the group
right the native protocol would need. Handlers are plain functions: Starlette
runs them on its thread pool, so the broker's blocking calls never stall the loop.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import structlog
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.console import access, render
from broker.console.config import ConsoleConfig
from broker.console.history import History, plot
from broker.console.listener import SizeLimits
from broker.console.session import Sessions
from broker.console.sources import Backlog, BrokerView, Counters, Letter, LetterBook
from broker.console.throttle import LoginThrottle, retry_after
from broker.delivery.values import GroupInfo
from broker.errors import BrokerError, BrokerUnavailableError
from broker.protocol.errors import PermissionDeniedError
from broker.protocol.operations import OPERATIONS
from broker.server.auth import Authenticator, Principal
from broker.server.throttle import client_address
from broker.store.clock import SYSTEM_CLOCK, Clock

HERE = Path(__file__).parent
log = structlog.get_logger("broker.console")
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; style-src 'self'; img-src 'self'; "
                                 b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),  # a page of dead letters is not kept on a shared machine's disk
]

# a lookup by key covers all time, with the native protocol's own bounds (begin, end, limit)
LOOKUP_KEY_RANGE = tuple(f.default for f in OPERATIONS["lookup_key"].fields if f.name in ("begin", "end", "limit"))


class SecurityHeaders:
    """Adds the headers that forbid scripts, framing, sniffing and caching to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).extend(SECURITY_HEADERS)
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Console:
    """The pages over one `BrokerView` (optional: another transport has none) and `LetterBook`."""

    def __init__(self, config: ConsoleConfig, authenticator: Authenticator, view: BrokerView | None,
                 letters: LetterBook | None, history: History | None, backlog: Backlog | None = None,
                 counters: Counters | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config, self.view, self.letters, self.history = config, view, letters, history
        self.backlog, self.counters = backlog, counters
        self.sessions = Sessions(authenticator, config.session_max_age, config.max_sessions,
                                 config.max_sessions_per_user, clock)
        self.throttle = LoginThrottle(config.login_max_failures, config.login_max_failures_per_address,
                                      config.login_window, config.login_lockout, config.login_max_lockout,
                                      config.login_tracked, clock)
        self.password_checks = anyio.CapacityLimiter(config.login_concurrency)
        self.proxies, self.clock = config.proxies, clock
        self.templates = Environment(loader=FileSystemLoader(HERE / "templates"),
                                     autoescape=select_autoescape(default=True))
        self.templates.filters.update(when=_when, preview=render.preview, size=render.size)

    # -- plumbing -------------------------------------------------------------
    def page(self, request: Request, name: str, status: int = 200, **values: Any) -> HTMLResponse:
        principal = self.sessions.principal(request)
        html = self.templates.get_template(name).render(
            user=principal.name if principal else None, csrf=self.sessions.csrf_token(request),
            has_broker=self.view is not None, has_backlog=bool(self.backlog and principal and principal.admin),
            has_counters=bool(self.counters and principal and principal.admin),
            **values)
        return HTMLResponse(html, status_code=status)

    def denied(self, request: Request, why: str) -> HTMLResponse:
        return self.page(request, "error.html", status=403, message=why)

    def unavailable(self, request: Request, exc: Exception) -> HTMLResponse:
        """Any page while the broker behind the console cannot be reached: 503, saying so."""
        log.warning("console.broker_unavailable", path=request.url.path, error=str(exc))
        return self.page(request, "error.html", status=503,
                         message=f"the broker cannot be reached ({exc}); try again once it is back")

    def who(self, request: Request) -> Principal | Response:
        principal = self.sessions.principal(request)
        return principal if principal else RedirectResponse("/login", status_code=303)

    def group(self, principal: Principal, name: str) -> GroupInfo | None:
        """The group called ``name`` if the user may see it (groups known only to the store count too)."""
        if not access.sees_group(principal, name):
            return None
        found = [g for g in (self.view.groups() if self.view else []) if g.name == name]
        return found[0] if found else GroupInfo(name, (), 0, False)

    def lag(self, principal: Principal, group: str) -> list[Any]:
        return access.visible(principal, "lag", self.view.lag(group)) if self.view else []

    # -- pages ----------------------------------------------------------------
    def login_form(self, request: Request) -> Response:
        return self.page(request, "login.html", error=None)

    async def login(self, request: Request) -> Response:
        form = await request.form()
        if not self.sessions.csrf_ok(request, form.get("csrf")):  # another site's form (login CSRF)
            return self.page(request, "login.html", status=403,
                             error="the log-in form's CSRF token is missing or wrong (an old or another "
                                   "site's form): log in with this one")
        login, password = str(form.get("user", "")), str(form.get("password", ""))
        address = client_address(request.client.host if request.client else "",
                                 request.headers.get("x-forwarded-for"), self.proxies)
        wait = self.throttle.admit(login, address)
        if wait:  # refused before any password is checked
            seconds = retry_after(wait)
            response = self.page(request, "login.html", status=429,
                                 error=f"too many failed log-ins for this user name or from this address: "
                                       f"try again in {seconds} s (at {_when(self.clock.time() + seconds)})")
            response.headers["retry-after"] = str(seconds)
            return response
        succeeded: bool | None = None
        try:  # scrypt takes tens of milliseconds of CPU: off the event loop, on a few threads of its
            # own, so a flood of attempts leaves the pages' threads free
            succeeded = await anyio.to_thread.run_sync(self.sessions.log_in, request, login, password,
                                                       limiter=self.password_checks)
        finally:
            self.throttle.settle(login, address, succeeded)
        if succeeded:
            return RedirectResponse("/", status_code=303)
        log.info("console.login_failed", user=login[:100], address=address)
        return self.page(request, "login.html", status=401, error="wrong user name or password")

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if not self.sessions.csrf_ok(request, form.get("csrf")):
            return self.denied(request, "the form's CSRF token is missing or wrong")
        self.sessions.log_out(request)
        return RedirectResponse("/login", status_code=303)

    def home(self, request: Request) -> Response:
        return RedirectResponse("/topics" if self.view else "/groups", status_code=303)

    def topics(self, request: Request) -> Response:
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        rows = access.visible(principal, "topics", self.view.topics() if self.view else [])
        rates = {t.name: self.history.rate_of(t.name) if self.history else 0.0 for t in rows}
        return self.page(request, "topics.html", topics=rows, rates=rates)

    def groups(self, request: Request) -> Response:
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        known = self.view.groups() if self.view else []
        named = {g.name for g in known}
        kept = [GroupInfo(name, (), 0, False) for name in (self.letters.groups() if self.letters else [])
                if name not in named]
        rows = access.visible(principal, "groups", known) + [g for g in kept if access.sees_group(principal, g.name)]
        lag = {g.name: sum(q.end - q.committed for q in self.lag(principal, g.name)) for g in rows}
        letters = {g.name: self.letters.count(g.name) for g in rows
                   if self.letters and access.reads_letters(principal, g.name)}
        return self.page(request, "groups.html", groups=rows, lag=lag, letters=letters)

    def group_page(self, request: Request) -> Response:
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        name = request.path_params["group"]
        info = self.group(principal, name)
        if info is None:
            return self.denied(request, f"you may not see group {name!r}")
        reads = access.reads_letters(principal, name)
        curve = plot(self.history.lag_of(name)) if self.history else None
        counts = {"framework": self.letters.count(name) if self.letters and reads else None,
                  "broker": self.view.dlq_waiting(name) if self.view and reads else None}
        return self.page(request, "group.html", group=info, lag=self.lag(principal, name), curve=curve,
                         counts=counts, reads=reads)

    def letters_page(self, request: Request) -> Response:
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        name, source = request.path_params["group"], request.query_params.get("source", "framework")
        if not access.reads_letters(principal, name):
            return self.denied(request, f"you may not read the dead letters of group {name!r}")
        after = _int(request.query_params.get("after"), 0)
        size = self.config.page_size
        if source == "broker" and self.view is not None:
            rows: list[Any] = self.view.dlq_list(name, size, body_limit=render.SHOWN)  # what a row shows
            total = self.view.dlq_waiting(name)
        elif source == "framework" and self.letters is not None:
            rows = self.letters.page(name, size + 1, after)
            total = self.letters.count(name)
        else:
            return self.page(request, "error.html", status=404, message=f"no dead letters kept as {source!r}")
        more = source == "framework" and len(rows) > size
        return self.page(request, "letters.html", group=name, source=source, rows=rows[:size], total=total,
                         next_after=rows[size - 1].id if more else None,
                         manages=access.manages_letters(principal, name), show=render.show)

    def letter_page(self, request: Request) -> Response:
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        letter_id = _int(request.path_params["id"], -1)  # not Starlette's int: 5000 digits raised, a 500
        letter: Letter | None = self.letters.get(letter_id) if self.letters and letter_id >= 0 else None
        if letter is None or not access.reads_letters(principal, letter.group):
            return self.page(request, "error.html", status=404, message="no such dead letter you may see")
        return self.page(request, "letter.html", letter=letter, body=render.show(letter.body),
                         manages=access.manages_letters(principal, letter.group))

    async def act(self, request: Request) -> Response:
        """Replay or purge dead letters of a group: the chosen ids, or all of the broker's."""
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        form = await request.form()
        name, action = request.path_params["group"], request.path_params["action"]
        if not self.sessions.csrf_ok(request, form.get("csrf")):
            return self.denied(request, "the form's CSRF token is missing or wrong")
        if action not in ("replay", "purge"):
            return self.page(request, "error.html", status=404, message=f"no action {action!r}")
        source, every = str(form.get("source", "framework")), form.get("all") == "1"
        try:  # the broker's letters chosen one by one are the *_letters operations
            access.check(principal, f"dlq_{action}" + ("_letters" if source == "broker" and not every else ""),
                         group=name)
        except PermissionDeniedError as exc:
            return self.denied(request, str(exc))
        ids = [i for i in (_int(str(v), -1) for v in form.getlist("id")) if i >= 0]
        try:
            done = await run_in_threadpool(self.apply, name, action, source, None if every else ids,
                                           form.get("force") == "1")
        except PermissionDeniedError as exc:
            return self.denied(request, str(exc))
        except BrokerError as exc:
            return self.page(request, "error.html", status=409, message=str(exc))
        return self.page(request, "done.html", group=name, action=action, count=done, source=source)

    def apply(self, group: str, action: str, source: str, ids: list[int] | None, force: bool) -> int:
        """Replay or purge the letters ``ids`` (of the broker's: their offsets in ``%DLQ%<group>``;
        None: all of the broker's)."""
        if source == "broker" and self.view is not None:
            if ids is None:
                return self.view.dlq_replay(group) if action == "replay" else self.view.dlq_purge(group)
            if not ids:
                return 0
            if action == "replay":
                return self.view.dlq_replay_letters(group, ids)
            return self.view.dlq_purge_letters(group, ids)
        if source != "framework" or self.letters is None or not ids:
            return 0
        if action == "replay":
            return self.letters.replay(group, ids, force=force)
        return self.letters.purge(group, ids)

    def outbox(self, request: Request) -> Response:
        """The outbox's backlog: deployment-wide figures, shown to admins as the server's counters are."""
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        if self.backlog is None or not principal.admin:
            return self.page(request, "error.html", status=404, message="no outbox backlog you may see")
        return self.page(request, "outbox.html", status_figures=self.backlog.status())

    def handlers(self, request: Request) -> Response:
        """The handlers' counters, scraped from the workers: deployment-wide, so for admins."""
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        if self.counters is None or not principal.admin:
            return self.page(request, "error.html", status=404, message="no handler counters you may see")
        rows = self.counters.table()
        outcomes = sorted({outcome for _, _, counts in rows for outcome in counts})
        return self.page(request, "handlers.html", rows=rows, outcomes=outcomes)

    def lookup(self, request: Request) -> Response:
        principal = self.who(request)
        if isinstance(principal, Response):
            return principal
        topic, key = request.query_params.get("topic", ""), request.query_params.get("key", "")
        message_id = request.query_params.get("id", "")
        found, error = [], None
        try:
            if self.view and message_id:
                message = self.view.lookup_id(message_id)  # None: no such message (an admin's 500)
                found = access.visible(principal, "lookup_id", [message] if message else [])
            elif self.view and topic and key:
                access.check(principal, "lookup_key", topic=topic)
                found = self.view.lookup_key(topic, key, *LOOKUP_KEY_RANGE)
        except PermissionDeniedError as exc:
            return self.denied(request, str(exc))
        except BrokerError as exc:
            error = str(exc)
        return self.page(request, "lookup.html", topic=topic, key=key, message_id=message_id,
                         found=found, error=error, show=render.show)


def build_console(config: ConsoleConfig, authenticator: Authenticator, view: BrokerView | None = None,
                  letters: LetterBook | None = None, history: History | None = None,
                  backlog: Backlog | None = None, counters: Counters | None = None,
                  secret: str | None = None, clock: Clock = SYSTEM_CLOCK) -> Starlette:
    """The ASGI application; ``secret`` signs session cookies (a random one: sessions end with the
    process); ``clock`` ages the sessions."""
    console = Console(config, authenticator, view, letters, history, backlog, counters, clock)
    routes = [
        Route("/login", console.login_form, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/", console.home), Route("/topics", console.topics), Route("/groups", console.groups),
        Route("/groups/{group}/letters", console.letters_page),
        Route("/groups/{group}/{action:str}", console.act, methods=["POST"]),
        Route("/groups/{group}", console.group_page),
        Route("/letters/{id}", console.letter_page), Route("/lookup", console.lookup),
        Route("/outbox", console.outbox), Route("/handlers", console.handlers),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [Middleware(SecurityHeaders), Middleware(SizeLimits),
                  Middleware(SessionMiddleware, secret_key=secret or secrets.token_urlsafe(32),
                             session_cookie="reliable_console", max_age=config.session_max_age,
                             same_site="strict", https_only=config.secure_cookie)]
    if not authenticator.required:  # open, so bound to loopback: refuse other names (DNS rebinding)
        own = f"[{config.host}]" if ":" in config.host else config.host
        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=["localhost", "127.0.0.1", "[::1]", own]))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={BrokerUnavailableError: console.unavailable})


def _int(text: str | None, default: int) -> int:
    return int(text) if text is not None and text.isascii() and text.isdigit() and len(text) < 19 else default


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if ts else ""
