"""Password hashes for the tests' broker users: scrypt at n = 2**10 instead of the default 2**14.

A stored hash names its own cost (``scrypt$n$r$p$salt$hash``) and the server
checks a password at that cost, so a user hashed here costs the server 4 ms a
log-in instead of 60 ms; the tests log in thousands of times (the access
matrix alone 211 tests). The checks are the server's own, unchanged: an
unknown user still costs the default work (the server's dummy hash), and the
tests of the hashing itself use `broker.server.auth.hash_password`.
"""

from __future__ import annotations

from typing import Any

from broker.server.auth import hash_password as _hash_password

SCRYPT_N = 2**10


def hash_password(password: str, **options: Any) -> str:
    """`broker.server.auth.hash_password` at the tests' cost (``n`` = `SCRYPT_N` unless given)."""
    return _hash_password(password, **{"n": SCRYPT_N, **options})
