"""Who may see and do what in the console: the native protocol's own rules, read off its table.

Each page or action asks the `Access` that `broker.protocol.operations`
declares for the operation it stands for (``topics``, ``groups``, ``lag``,
``dlq_list``, ``dlq_replay``, ``dlq_purge``, ``dlq_replay_letters``,
``dlq_purge_letters``, ``lookup_key``, ``lookup_id``), so
the console can never allow what the native protocol refuses. The framework's
dead letters of a group need what the broker's dead letters of that group
need. Natively, reading a group's dead letters and replaying them need the
same right (the group, and consume on ``%DLQ%<group>``); a user with the group
right alone sees the group and its lag, but not its dead letters.
"""

from __future__ import annotations

from typing import Any

from broker.protocol.errors import PermissionDeniedError
from broker.protocol.operations import OPERATIONS
from broker.server.auth import Principal


def allowed(principal: Principal, operation: str, **args: Any) -> bool:
    """Whether the native protocol would let ``principal`` run ``operation`` with ``args``."""
    try:
        OPERATIONS[operation].access.check(principal, args)
    except PermissionDeniedError:
        return False
    return True


def check(principal: Principal, operation: str, **args: Any) -> None:
    """`PermissionDeniedError` naming the right ``principal`` lacks for ``operation``."""
    OPERATIONS[operation].access.check(principal, args)


def visible(principal: Principal, operation: str, items: list[Any]) -> list[Any]:
    """The items of a listing (``topics``, ``groups``, ``lag``) ``principal`` may see."""
    return list(OPERATIONS[operation].access.visible(principal, items))


def sees_group(principal: Principal, group: str) -> bool:
    return allowed(principal, "lag", group=group)


def reads_letters(principal: Principal, group: str) -> bool:
    return allowed(principal, "dlq_list", group=group)


def manages_letters(principal: Principal, group: str) -> bool:
    return allowed(principal, "dlq_replay", group=group) and allowed(principal, "dlq_purge", group=group)
