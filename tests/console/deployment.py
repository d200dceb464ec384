"""A small deployment for the console's tests: an app on the embedded broker, users, dead letters.

Group ``billing`` dead-letters payments listed in ``blocked`` (a fatal error);
group ``audit`` reads the same topic and only records what it saw, so a replay
that reached every group of the topic would show there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import text

from backends.clock import SYSTEM_CLOCK, Clock
from broker.console.config import ConsoleConfig
from broker.console.serving import ConsoleServer
from broker.server.auth import Authenticator, load_users
from reliable import App
from reliable.console import serve
from reliable.testing import test_app
from tests.passwords import hash_password

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "carol": "carol-pw", "ops": "ops-pw"}
USERS = {
    # alice runs billing: its group, its topic and its dead letters
    "alice": {"password_hash": hash_password(PASSWORDS["alice"]), "produce": ["payments"],
              "consume": ["payments", "%DLQ%billing"], "groups": ["billing"]},
    # bob may watch billing (the group right) but not read or touch its dead letters
    "bob": {"password_hash": hash_password(PASSWORDS["bob"]), "consume": ["payments"], "groups": ["billing"]},
    # carol has rights on another team's topic and group only
    "carol": {"password_hash": hash_password(PASSWORDS["carol"]), "consume": ["orders"], "groups": ["shipping"]},
    # ops is an admin: every right, and the deployment-wide figures (the outbox's backlog)
    "ops": {"password_hash": hash_password(PASSWORDS["ops"]), "admin": True},
}


@dataclass
class Deployment:
    app: App
    console: ConsoleServer
    blocked: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.console.url

    def seen(self, table: str) -> list[str]:
        with self.app.store.transaction() as tx:
            return [row[0] for row in tx.execute(text(f"select payment from {table} order by payment"))]


def start(directory: Path, authenticator: Authenticator | None = None, clock: Clock = SYSTEM_CLOCK,
          **console: object) -> Deployment:
    """The deployment, its console's settings from ``console``; ``clock`` is the app's and the
    console's (a fake one lets a test age sessions and lock-outs)."""
    app = test_app(directory, clock=clock, transport=f"embedded://{directory / 'broker'}",
                   settings={"RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    deployment = Deployment(app, None)  # type: ignore[arg-type]
    with app.store.transaction() as tx:
        for table in ("charged", "audited"):
            tx.execute(text(f"create table {table} (payment text)"))

    @app.handler("payments", group="billing", token="body.payment", fatal=(ValueError,))
    def charge(msg, tx) -> None:
        if msg.body["payment"] in deployment.blocked:
            raise ValueError(f"payment {msg.body['payment']} is blocked: {msg.body.get('note', '')}")
        tx.execute(text("insert into charged (payment) values (:p)"), {"p": msg.body["payment"]})

    @app.handler("payments", group="audit", token="body.payment")
    def audit(msg, tx) -> None:
        tx.execute(text("insert into audited (payment) values (:p)"), {"p": msg.body["payment"]})

    config = ConsoleConfig(port=0, sample_interval=0.05, page_size=50, **console)  # type: ignore[arg-type]
    deployment.console = serve(app, config, authenticator or Authenticator(load_users(USERS)))
    return deployment
