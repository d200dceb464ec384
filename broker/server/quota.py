"""How many new groups and topics one user may make: ``max_groups_per_user``, ``max_topics_per_user``.

A group is never deleted, and past ``max_groups`` (10,000) the broker refuses every new group,
whoever asks: one user allowed ``orders-*`` groups (or reading ``orders.*`` topics over STOMP,
one ``/topic/`` group each) could join 10,000 new group names and leave every other team
unable to make a group of its own. Each user (not an admin) now makes at most
``max_groups_per_user`` new groups on this server (since it started, as ``max_groups`` counts):
past it that user's join of a new group is refused; joins of groups that exist go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from broker.errors import TooManyGroupsError, TooManyTopicsError
from broker.protocol.access import Rights, owning_group


class GroupQuota:
    """The new groups each user made (one event loop), and the decision on each join."""

    def __init__(self, limit: int, known: Callable[[str], bool]) -> None:
        self.limit, self.known = limit, known
        self._made: dict[str, set[str]] = {}

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


class TopicQuota:
    """The new topic names each user named (one event loop): at most ``max_topics_per_user``.

    Past ``max_topics`` the broker refuses every new topic, whoever asks, as with groups: each
    user (not an admin) names at most this many topics the broker did not hold, in a publish,
    a join or a read (counted when named, whether or not the request then made the topic)."""

    def __init__(self, limit: int, known: Callable[[str], bool]) -> None:
        self.limit, self.known = limit, known
        self._made: dict[str, set[str]] = {}

    @classmethod
    def unbounded(cls) -> TopicQuota:
        """No bound: a context served by no server (a test's)."""
        return cls(2**62, lambda topic: True)

    def made(self) -> dict[str, int]:
        """How many new topics each user named (``broker_user_topics``)."""
        return {user: len(topics) for user, topics in self._made.items()}

    def charge(self, rights: Rights, topics: list[str]) -> None:
        """``rights``' user names ``topics``; `TooManyTopicsError` if the new among them would
        take it past its limit (a group's ``%RETRY%`` and ``%DLQ%``: ``max_groups_per_user``)."""
        if rights.admin:
            return
        made = self._made.get(rights.name, set())
        new = [t for t in dict.fromkeys(topics) if t not in made and owning_group(t) is None and not self.known(t)]
        if not new:
            return
        if len(made) + len(new) > self.limit:
            raise TooManyTopicsError(
                f"topic {new[0]!r}: user {rights.name!r} made max_topics_per_user={self.limit} topics "
                "on this server already, so it cannot make another (its topics still take messages); "
                "ask an admin to raise max_topics_per_user")
        self._made[rights.name] = made | set(new)
