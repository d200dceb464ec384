"""How many new groups one user may make: ``max_groups_per_user``.

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

from broker.errors import TooManyGroupsError
from broker.protocol.access import Rights


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
