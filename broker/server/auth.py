"""Users, hashed passwords and per-topic permissions for both listeners.

A password is stored only as a self-describing hash: ``scrypt$n$r$p$salt$hash``
(`hash_password`'s default) or ``pbkdf2_sha256$iterations$salt$hash``, salt
and hash in URL-safe base64. Verification recomputes the hash and compares in
constant time; an unknown user costs the same work as a wrong password.

Permissions are shell-style patterns over names (``orders.*``, ``*``): one
list of topics a user may produce to, one of topics it may consume from,
one of groups it may act as (join, fetch and ack as a member, commit its
offsets, handle its dead letters), and ``admin = true`` for every right
(`broker.protocol.access` says which operation needs which). With no users
configured the broker is open (every client is an admin); `broker.server.config`
refuses such a broker on anything but a loopback address.
"""

from __future__ import annotations

import base64
import fnmatch
import functools
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from broker.errors import BrokerConfigError
from broker.protocol.errors import AuthenticationError

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
PBKDF2_ITERATIONS = 600_000
_DKLEN = 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_password(password: str, *, method: str = "scrypt", salt: bytes | None = None,
                  n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P,
                  iterations: int = PBKDF2_ITERATIONS) -> str:
    """The stored form of ``password``: ``scrypt$...`` (default) or ``pbkdf2_sha256$...``."""
    salt = os.urandom(16) if salt is None else salt
    secret = password.encode()
    if method == "scrypt":
        digest = hashlib.scrypt(secret, salt=salt, n=n, r=r, p=p, dklen=_DKLEN,
                                maxmem=256 * n * r + (1 << 20))
        return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(digest)}"
    if method == "pbkdf2_sha256":
        digest = hashlib.pbkdf2_hmac("sha256", secret, salt, iterations, _DKLEN)
        return f"pbkdf2_sha256${iterations}${_b64(salt)}${_b64(digest)}"
    raise BrokerConfigError(f"password hash method {method!r} is not one of scrypt, pbkdf2_sha256")


def verify_password(password: str, encoded: str) -> bool:
    """Whether ``password`` matches the stored hash ``encoded`` (constant-time compare)."""
    method, _, rest = encoded.partition("$")
    fields = rest.split("$")
    if method == "scrypt" and len(fields) == 5:
        n, r, p = (int(x) for x in fields[:3])
        again = hash_password(password, salt=_unb64(fields[3]), n=n, r=r, p=p)
    elif method == "pbkdf2_sha256" and len(fields) == 3:
        again = hash_password(password, method=method, salt=_unb64(fields[1]),
                              iterations=int(fields[0]))
    else:
        raise BrokerConfigError(f"stored password hash {encoded[:20]!r}... is not scrypt$ or pbkdf2_sha256$")
    return hmac.compare_digest(again.encode(), encoded.encode())


def check_hash(encoded: str, where: str) -> str:
    """``encoded`` if it is a hash `verify_password` can use; `BrokerConfigError` naming ``where``."""
    method, _, rest = encoded.partition("$")
    fields = rest.split("$")
    shapes = {"scrypt": 5, "pbkdf2_sha256": 3}
    numeric = fields[: shapes.get(method, 0) - 2]
    if shapes.get(method) != len(fields) or not all(x.isdigit() for x in numeric):
        raise BrokerConfigError(
            f"{where} = {encoded[:20]!r}...: not a password hash; allowed: scrypt$n$r$p$salt$hash "
            f"or pbkdf2_sha256$iterations$salt$hash (make one with broker.server.auth.hash_password)")
    return encoded


@dataclass(frozen=True)
class User:
    """One account: a password hash, the topic patterns it may produce to and consume from, the
    group patterns it may act as, and whether it is an admin."""

    name: str
    password_hash: str
    produce: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    admin: bool = False


@dataclass(frozen=True)
class Principal:
    """Who a connection is, once authenticated, and what it may do (`broker.protocol.access.Rights`)."""

    name: str
    produce: tuple[str, ...]
    consume: tuple[str, ...]
    groups: tuple[str, ...] = ()
    admin: bool = False

    def may_produce(self, topic: str) -> bool:
        return any(fnmatch.fnmatchcase(topic, pattern) for pattern in self.produce)

    def may_consume(self, topic: str) -> bool:
        return any(fnmatch.fnmatchcase(topic, pattern) for pattern in self.consume)

    def may_join(self, group: str) -> bool:
        return any(fnmatch.fnmatchcase(group, pattern) for pattern in self.groups)


OPEN = Principal("anonymous", ("*",), ("*",), ("*",), admin=True)


@functools.cache
def _dummy_hash() -> str:
    return hash_password("", salt=b"\0" * 16)


class Authenticator:
    """Checks credentials against the configured users; with none configured, everyone is `OPEN`."""

    def __init__(self, users: Mapping[str, User] | None = None) -> None:
        self.users = dict(users or {})

    @property
    def required(self) -> bool:
        return bool(self.users)

    def authenticate(self, login: str | None, password: str | None) -> Principal:
        """The principal for these credentials; `AuthenticationError` if they are missing or wrong."""
        if not self.required:
            return OPEN
        if not login or password is None:
            raise AuthenticationError("credentials are required")
        user = self.users.get(login)
        matches = verify_password(password, user.password_hash if user else _dummy_hash())
        if user is None or not matches:
            raise AuthenticationError(f"wrong user name or password for {login!r}")
        return self.principal(login) or OPEN

    def principal(self, name: str) -> Principal | None:
        """The rights of the configured user ``name`` now (None if there is no such user)."""
        user = self.users.get(name)
        return None if user is None else Principal(user.name, user.produce, user.consume, user.groups, user.admin)


def load_users(data: Mapping[str, object], where: str = "broker.users") -> dict[str, User]:
    """Users from a settings table ``{name: {password_hash, produce, consume, groups, admin}}``,
    validated."""
    users = {}
    for name, entry in data.items():
        if not isinstance(entry, Mapping):
            raise BrokerConfigError(f"{where}.{name} = {entry!r}: must be a table")
        unknown = set(entry) - {"password_hash", "produce", "consume", "groups", "admin"}
        if unknown:
            raise BrokerConfigError(f"{where}.{name}: unknown keys {sorted(unknown)}; "
                                    "allowed: password_hash, produce, consume, groups, admin")
        password_hash = check_hash(str(entry.get("password_hash", "")), f"{where}.{name}.password_hash")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise BrokerConfigError(f"{where}.{name}.admin = {admin!r}: must be true or false")
        produce, consume, groups = (_patterns(entry, key, f"{where}.{name}")
                                    for key in ("produce", "consume", "groups"))
        users[name] = User(name, password_hash, produce, consume, groups, admin)
    return users


def _patterns(entry: Mapping[str, object], key: str, where: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list | tuple) or not all(isinstance(x, str) and x for x in value):
        raise BrokerConfigError(f"{where}.{key} = {value!r}: must be a list of name patterns")
    return tuple(value)
