"""The rights an operation needs, after the ACLs of RabbitMQ, ActiveMQ and Kafka.

Topics and groups are resources, each granted by shell-style name patterns:
a user may *produce* to a topic, *consume* from a topic, and act as a
*group* (join it, fetch and acknowledge as its member, commit or read its
offsets, list, replay or purge its dead letters, publish into it). An
operation on a group needs the right on the group **and** on the topics it
touches, as Kafka needs READ on both the group and the topic. An *admin*
holds every right. A listing is open to every signed-in user and shows only
what that user may see.

`Access` is declared per operation in `broker.protocol.operations`; the
server checks it before any engine call, for both listeners.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from broker.delivery.group import dlq_topic
from broker.protocol.errors import PermissionDeniedError

INTERNAL = ("%RETRY%", "%DLQ%")
"""Prefixes of a group's own topics: ``%RETRY%<group>`` and ``%DLQ%<group>``."""


class Rights(Protocol):
    """What a signed-in user may do (`broker.server.auth.Principal`)."""

    @property
    def name(self) -> str: ...
    @property
    def admin(self) -> bool: ...

    def may_produce(self, topic: str) -> bool: ...
    def may_consume(self, topic: str) -> bool: ...
    def may_join(self, group: str) -> bool: ...


def owning_group(topic: str) -> str | None:
    """The group whose retry or dead-letter topic ``topic`` is, else None."""
    for prefix in INTERNAL:
        if topic.startswith(prefix):
            return topic.removeprefix(prefix)
    return None


def may_see_topic(rights: Rights, topic: str) -> bool:
    """A topic shows in a listing to whoever may produce to it or consume from it; a group's
    retry and dead-letter topics to whoever may act as the group."""
    if rights.admin or rights.may_produce(topic) or rights.may_consume(topic):
        return True
    group = owning_group(topic)
    return group is not None and rights.may_join(group)


Shows = Callable[[Rights, Any], bool]
"""Whether one item of a listing's reply is shown to ``rights``."""


@dataclass(frozen=True)
class Access:
    """The rights one operation needs, named by the request fields holding the resources.

    ``produce`` / ``consume``: fields naming a topic or a list of topics; ``group``: the field
    naming the group it acts as; ``dead_letters``: the field naming a group whose dead-letter
    queue it reads or changes (the group's right and consume on ``%DLQ%<group>``); ``member``:
    it acts as a member joined on this connection (whose rights were checked when it joined);
    ``anyone``: any signed-in user (a listing filtered by ``shows``). An `Access` naming none of
    these is undeclared, and the operation table refuses it.
    """

    produce: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    group: str = ""
    dead_letters: str = ""
    member: bool = False
    anyone: bool = False
    shows: Shows | None = None

    @property
    def declared(self) -> bool:
        return bool(self.produce or self.consume or self.group or self.dead_letters
                    or self.member or self.anyone)

    def check(self, rights: Rights, args: Mapping[str, Any]) -> None:
        """`PermissionDeniedError` naming the user, the right and the resource it lacks."""
        if rights.admin:
            return
        for name in self.produce:
            for topic in _names(args[name]):
                if not rights.may_produce(topic):
                    raise PermissionDeniedError(f"user {rights.name!r} may not produce to topic {topic!r}")
        for name in self.consume:
            for topic in _names(args[name]):
                if not rights.may_consume(topic):
                    raise PermissionDeniedError(f"user {rights.name!r} may not consume from topic {topic!r}")
        for name in (self.group, self.dead_letters):
            if name and not rights.may_join(args[name]):
                raise PermissionDeniedError(f"user {rights.name!r} may not act as group {args[name]!r}")
        if self.dead_letters and not rights.may_consume(dlq_topic(args[self.dead_letters])):
            raise PermissionDeniedError(f"user {rights.name!r} may not consume from topic "
                                        f"{dlq_topic(args[self.dead_letters])!r}")

    def topics(self, args: Mapping[str, Any]) -> list[str]:
        """The topics a request of this operation names (to produce to or consume from)."""
        return [topic for name in (*self.produce, *self.consume) for topic in _names(args[name])]

    def visible(self, rights: Rights, items: list[Any]) -> list[Any]:
        """The items of a listing ``rights`` may see (all of them for an admin)."""
        if self.shows is None or rights.admin:
            return items
        return [item for item in items if self.shows(rights, item)]

    def describe(self) -> str:
        """The rights in words, for docs/broker-server.md."""
        needs = [f"produce on `{n}`" for n in self.produce]
        needs += [f"consume on `{n}`" for n in self.consume]
        needs += [f"group `{self.group}`"] if self.group else []
        needs += [f"group `{n}` and consume on `%DLQ%<{n}>`" for n in filter(None, [self.dead_letters])]
        needs += ["a member joined on this connection"] if self.member else []
        needs += ["signed in"] if self.anyone else []
        return ", ".join(needs) + ("; shows only what the user may see" if self.shows else "")


def _names(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
