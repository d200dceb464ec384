"""The one place a backend URL is made safe to show: in logs, errors and reprs."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL urllib can split: show nothing of what follows the scheme
        return url.split("://", 1)[0] + "://***" if "://" in url else "***"
    if not password:
        return url
    netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
