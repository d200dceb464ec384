"""What a server's refusal of a backend's settings means, by whether the backend ever worked.

A wrong password, a role, database or virtual host that does not exist: the
server answers, and refuses. Before the backend ever worked, the settings
are wrong and no wait fixes them: `BackendRefusedError` (a
`ConfigurationError`), which stops a worker, a relay and a command with the
setting named and the server's words. Once it has worked, something changed
on the server (a password rotated, a database being restored): that may be
put right while the process runs, so it is an outage like any other, waited
out, but logged at error level as a refusal naming the setting
(``backend_refused``), and readiness is false meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from backends.errors import BackendRefusedError, BackendUnavailableError, ReliableError

log = structlog.get_logger("backends.refusal")


class FirstContact:
    """One backend's history with its server: whether the server ever accepted its settings."""

    def __init__(self, setting: str, value: str) -> None:
        self.setting = f"{setting} = {value!r}"  # e.g. "[store] url = 'postgresql://...'" (no password)
        self.worked = False

    def accepted(self) -> None:
        """The server took the settings (a connection was made, a login accepted)."""
        self.worked = True

    def refused(self, words: str, outage: Callable[[str], BackendUnavailableError]) -> ReliableError:
        """The error for a refusal in the server's ``words``: `BackendRefusedError` before the
        backend ever worked, else ``outage(text)``, logged as an error."""
        words = " ".join(words.split())  # libpq's, say, end in a newline
        if not self.worked:
            return BackendRefusedError(self.setting, words)
        log.error("backend_refused", setting=self.setting, error=words,
                  hint="it worked before: waited out as an outage until the server takes it again")
        return outage(f"{self.setting}: the server refused it: {words}")
