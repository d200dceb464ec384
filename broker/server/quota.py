"""How many new groups and topics one user may make: ``max_groups_per_user``, ``max_topics_per_user``.

A group is never deleted, and past ``max_groups`` (10,000) the broker refuses every new group,
whoever asks: one user allowed ``orders-*`` groups (or reading ``orders.*`` topics over STOMP,
one ``/topic/`` group each) could join 10,000 new group names and leave every other team
unable to make a group of its own. Each user (not an admin) makes at most
``max_groups_per_user`` new groups, and ``max_topics_per_user`` new topics: past it that
user's request naming another new one is refused; its groups and topics go on.

What a user made is counted only once it exists: a request that names a new topic holds a
place for it while it runs, and gives the place back if the topic was not made (the request
failed, or a read made nothing). Who made each is written to ``quota-owners.journal`` in the
broker's ``delivery`` folder (a line appended, not fsynced: the page cache survives the
server's own death), so the counts survive a restart; at start only the entries whose group or
topic the broker still holds count.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog

from broker.errors import CorruptStoreError, TooManyGroupsError, TooManyTopicsError
from broker.protocol.access import Rights, owning_group

log = structlog.get_logger("broker.server")


class Owners:
    """Who made which group and topic: lines ``["group"|"topic", name, user]`` at ``path``
    (None: remembered by nobody, a server over an engine of another process)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def made(self, kind: str, exists: Callable[[str], bool]) -> dict[str, set[str]]:
        """The ``kind`` names each user made that still exist."""
        found: dict[str, set[str]] = {}
        for number, line in enumerate(self._lines(), 1):
            try:
                entry_kind, name, user = json.loads(line)
            except (ValueError, TypeError) as exc:
                raise CorruptStoreError(f"{self.path}: line {number} cannot be read ({exc})") from exc
            if entry_kind == kind and exists(name):
                found.setdefault(str(user), set()).add(str(name))
        return found

    def add(self, kind: str, name: str, user: str) -> None:
        """``user`` made ``name``; not written down (a full disk) it is logged, and the request
        that made it still succeeds: after a restart the user may make one more."""
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as journal:
                journal.write(json.dumps([kind, name, user]) + "\n")
        except OSError as exc:
            log.warning("server.owner_not_written", path=str(self.path), kind=kind, name=name, user=user,
                        error=str(exc))

    def _lines(self) -> list[bytes]:
        """The whole lines; a last one cut short (a crash, a full disk) is cut off the file, so
        the next line appended starts a line of its own."""
        try:
            data = self.path.read_bytes() if self.path is not None else b""
        except FileNotFoundError:
            return []
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) < len(data) and self.path is not None:
            os.truncate(self.path, len(whole))
        return whole.splitlines()


class GroupQuota:
    """The new groups each user made (one event loop), and the decision on each join."""

    def __init__(self, limit: int, known: Callable[[str], bool], owners: Owners | None = None) -> None:
        self.limit, self.known = limit, known
        self.owners = owners or Owners(None)
        self._made: dict[str, set[str]] = self.owners.made("group", known)

    @classmethod
    def unbounded(cls) -> GroupQuota:
        """No bound: a context served by no server (a test's)."""
        return cls(2**62, lambda group: True)

    def made(self) -> dict[str, int]:
        """How many new groups each user made (``broker_user_groups``)."""
        return {user: len(groups) for user, groups in self._made.items()}

    @contextmanager
    def joining(self, rights: Rights, group: str) -> Iterator[None]:
        """Around a join of ``group`` by ``rights``' user: counted as made by it if new (not if
        the join fails); `TooManyGroupsError` past the user's limit."""
        if rights.admin or group in self._made.get(rights.name, ()) or self.known(group):
            yield
            return
        made = self._made.setdefault(rights.name, set())
        if len(made) >= self.limit:
            raise TooManyGroupsError(
                f"group {group!r}: user {rights.name!r} made max_groups_per_user={self.limit} groups "
                "on this server already, so it cannot make another (its groups still join); ask an "
                "admin to raise max_groups_per_user")
        made.add(group)
        try:
            yield
        except BaseException:
            made.discard(group)
            raise
        self.owners.add("group", group, rights.name)


class TopicQuota:
    """The new topics each user made (one event loop): at most ``max_topics_per_user``.

    Past ``max_topics`` the broker refuses every new topic, whoever asks, as with groups: each
    user (not an admin) makes at most this many topics, in a publish, a join or a read. A
    request naming topics the broker does not hold is `charge`\\ d a place for each while it
    runs and `settle`\\ s after: the places of topics it did not make are given back."""

    def __init__(self, limit: int, known: Callable[[str], bool], owners: Owners | None = None) -> None:
        self.limit, self.known = limit, known
        self.owners = owners or Owners(None)
        self._made: dict[str, set[str]] = self.owners.made("topic", known)
        self._naming: dict[str, Counter[str]] = {}  # new topics named by requests running now

    @classmethod
    def unbounded(cls) -> TopicQuota:
        """No bound: a context served by no server (a test's)."""
        return cls(2**62, lambda topic: True)

    def made(self) -> dict[str, int]:
        """How many new topics each user made (``broker_user_topics``)."""
        return {user: len(topics) for user, topics in self._made.items()}

    def charge(self, rights: Rights, topics: list[str]) -> list[str]:
        """``rights``' user names ``topics`` in a request: the new among them, whose places the
        request holds until it is `settle`\\ d; `TooManyTopicsError` if they would take the user
        past its limit (a group's ``%RETRY%`` and ``%DLQ%``: ``max_groups_per_user``)."""
        if rights.admin:
            return []
        made, naming = self._made.get(rights.name, set()), self._naming.get(rights.name, Counter())
        new = [t for t in dict.fromkeys(topics) if t not in made and owning_group(t) is None and not self.known(t)]
        if len(made) + len(naming) + sum(t not in naming for t in new) > self.limit:
            raise TooManyTopicsError(
                f"topic {new[0]!r}: user {rights.name!r} made max_topics_per_user={self.limit} topics "
                "on this server already, so it cannot make another (its topics still take messages); "
                "ask an admin to raise max_topics_per_user")
        if new:
            self._naming.setdefault(rights.name, Counter()).update(new)
        return new

    def settle(self, rights: Rights, named: list[str]) -> None:
        """The request that was `charge`\\ d ``named`` ended: the topics it made count as the
        user's, the places of the others are given back."""
        naming = self._naming.get(rights.name, Counter())
        for topic in named:
            naming[topic] -= 1
            if naming[topic] <= 0:
                del naming[topic]
            made = self._made.setdefault(rights.name, set())
            if topic not in made and self.known(topic):
                made.add(topic)
                self.owners.add("topic", topic, rights.name)
        if not naming:
            self._naming.pop(rights.name, None)
        if not self._made.get(rights.name, True):
            del self._made[rights.name]

    @contextmanager
    def naming(self, rights: Rights, topics: list[str]) -> Iterator[None]:
        """Around a request naming ``topics``: `charge` then `settle`."""
        named = self.charge(rights, topics)
        try:
            yield
        finally:
            self.settle(rights, named)

    def check(self, rights: Rights, topics: list[str]) -> None:
        """`TooManyTopicsError` if a request naming ``topics`` would be refused now (nothing held)."""
        self.settle(rights, self.charge(rights, topics))
