"""`Membership`: the consumer groups, their members and cursors, and the groups' offsets.

A member joins a group (clustering or broadcasting, ordered or not), is kept
alive by its calls and leaves, or is dropped once silent past the session
timeout; each change rebalances the group's queues over its members
(`group.Group.rebalance`, by the allocation strategy). A new cursor starts at
the group's committed offset, else at the first message stored at or after
``from_time``, else at the queue's end (``from_end``) or its first kept
message. Under ``flush = "sync"`` the ack journal (`ackjournal`) records each
ack and each seek; `save_offsets` writes the clustering cursors' committed
offsets to the offset book and compacts the journal.

`Membership` is called under the consuming lock (`consume.Consuming`); what
a member that leaves held lapses through `leases.Leases`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import structlog

from broker.delivery import admin
from broker.delivery.ackjournal import COMPACT_BYTES, Acked, AckJournal
from broker.delivery.allocation import Strategy
from broker.delivery.config import DeliveryConfig
from broker.delivery.cursor import QueueCursor
from broker.delivery.group import Group, Member
from broker.delivery.leases import Leases
from broker.delivery.offsets import OffsetBook
from broker.delivery.reading import first_at
from broker.delivery.values import GroupInfo, QueueLag
from broker.errors import DeliveryError, TooManyGroupsError, UnknownMemberError
from broker.store import Clock, MessageStore

log = structlog.get_logger("broker.delivery")


class Membership:
    """Groups and members over ``store``; ``queues(topic)``: a topic's queue count; ``acks``: the
    ack journal (``sync`` only), ``acked_before``: what it replayed at start."""

    def __init__(self, store: MessageStore, offsets: OffsetBook, config: DeliveryConfig, clock: Clock,
                 strategy: Strategy, queues: Callable[[str], int], leases: Leases,
                 acks: AckJournal | None, acked_before: Acked) -> None:
        self._store = store
        self._offsets = offsets
        self._config = config
        self._clock = clock
        self._strategy = strategy
        self._queues = queues
        self._leases = leases
        self.acks = acks
        self._acked_before = acked_before  # taken by `_cursor`
        self.group_table: dict[str, Group] = {}
        self._occupied: dict[str, Group] = {}  # the groups with members: only they hold leases
        self._members: dict[str, Member] = {}
        self._needed: dict[tuple[str, int], int] = offsets.lowest_needed()

    # -- members ------------------------------------------------------------------------

    def join(self, group: str, topics: Sequence[str], *, broadcast: bool, from_end: bool,
             prefetch: int | None, lease: float | None, tags: Sequence[str] | None, ordered: bool,
             from_time: float | None) -> str:
        """A new member of ``group`` (see `Broker.join`); names already checked."""
        existing = self.group_table.get(group)
        if existing is None and len(self.group_table) >= self._config.max_groups:
            raise TooManyGroupsError(
                f"group {group!r}: the broker holds max_groups={self._config.max_groups} groups, so a new "
                "group cannot join (members of existing groups still can); raise max_groups")
        if existing is not None and (existing.broadcast, existing.ordered) != (broadcast, ordered):
            kind = "broadcasting" if existing.broadcast else "clustering"
            kind += ", ordered" if existing.ordered else ""
            raise DeliveryError(f"group {group!r} is {kind}; a member cannot join it otherwise")
        found = existing or Group(group, broadcast=broadcast, strategy=self._strategy, ordered=ordered)
        self.group_table[group] = self._occupied[group] = found
        member = found.new_member(tuple(topics), prefetch or self._config.prefetch,
                                  lease or self._config.lease, self._clock.monotonic(),
                                  frozenset(tags) if tags else None)
        self._members[member.ident] = member
        self._leases.open_window(member.ident)
        try:
            self._rebalance(found, from_end, from_time)
        except BaseException:  # a topic it needs could not be recorded (a full disk): no ghost stays
            self._drop(member, "delivery.member_join_failed")
            raise
        log.info("delivery.member_joined", group=group, member=member.ident, topics=list(topics),
                 queues=len(member.queues))
        return member.ident

    def leave(self, member: str) -> bool:
        """``member`` leaves its group; whether it was there."""
        found = self._members.get(member)
        if found is not None:
            self._drop(found, "delivery.member_left")
        return found is not None

    def expire(self, now: float) -> bool:
        """Members silent past the session timeout leave; whether any did."""
        silent = [m for m in self._members.values() if now - m.last_seen > self._config.session_timeout]
        for member in silent:
            self._drop(member, "delivery.member_expired")
        return bool(silent)

    def member(self, ident: str) -> Member:
        """The live member ``ident`` (its heartbeat noted), or `UnknownMemberError`."""
        found = self._members.get(ident)
        if found is None:
            raise UnknownMemberError(f"member {ident!r} is not in its group (it left or timed out)")
        found.last_seen = self._clock.monotonic()
        return found

    def group_of(self, member: Member) -> Group:
        return self.group_table[member.group]

    def assignment(self, member: str) -> list[tuple[str, int]]:
        return list(self.member(member).queues)

    def has_members(self, group: str) -> bool:
        """Whether ``group`` has members now (one silent past the session timeout has left)."""
        found = self.group_table.get(group)
        return found is not None and bool(found.members)

    def forward(self, group: str, topic: str, offsets: Sequence[int]) -> bool:
        """A position reader committed ``offsets`` of ``topic`` for ``group``, which has no member:
        its cursors move forward to them (never back), so a member joining later starts there,
        and what was acked above them stays done. Under ``sync`` the ack journal records the
        commit as a seek, with what is done above it (a restart takes the journal's last seek
        over the offset book: an earlier seek would move the group back); whether it did."""
        found = self.group_table.get(group)
        if found is not None and found.broadcast:
            return False
        for queue, offset in enumerate(offsets):
            key = (group, topic, queue)
            cursor = found.cursors.get((topic, queue)) if found is not None else None
            if cursor is not None:
                cursor.forward(int(offset))
            if self.acks is not None:
                committed = max(int(offset), self._offsets.get(key) or 0, cursor.committed if cursor else 0)
                above = (cursor.done | cursor.acked_ahead) if cursor else self._acked_before.get(key, set())
                self.acks.record(key, committed)
                if done := {o for o in above if o >= committed}:
                    self.acks.record(key, done)
        return self.acks is not None

    def journal(self, member: Member) -> AckJournal | None:
        """Where ``member``'s acks are recorded: the ack journal, for a clustering group under
        ``sync`` (a broadcasting member keeps its own offsets)."""
        return None if self.acks is None or self.group_table[member.group].broadcast else self.acks

    def leased_cursors(self) -> Iterator[tuple[Group, QueueCursor]]:
        """The cursors that may hold leases, with their group: those of groups with members (a
        member that leaves lapses what it held, so an empty group holds nothing out). A sweep
        costs the groups in use, not every group ever joined."""
        return ((group, cursor) for group in self._occupied.values() for cursor in group.all_cursors())

    def _drop(self, member: Member, event: str) -> None:
        group = self.group_table[member.group]
        # every cursor: a queue that moved away at a rebalance may still hold its messages
        self._leases.member_left(group, member.ident,
                                 member.own.values() if group.broadcast else group.cursors.values())
        del group.members[member.ident]
        del self._members[member.ident]
        if not group.members:
            del self._occupied[group.name]
            for cursor in group.all_cursors():
                cursor.spill()
        self._leases.close_window(member.ident)
        self._rebalance(group, from_end=False)
        log.info(event, group=member.group, member=member.ident)

    def _rebalance(self, group: Group, from_end: bool, from_time: float | None = None) -> None:
        moved = group.rebalance(self._queues)
        for member in group.members.values():
            table = member.own if group.broadcast else group.cursors
            for topic, queue in member.queues:
                if (topic, queue) not in table:
                    table[(topic, queue)] = self._cursor(group, topic, queue, from_end, from_time)
        if moved:  # the new holder waits until the old one has finished what it holds
            log.info("delivery.rebalanced", group=group.name, generation=group.generation,
                     moved=len(moved), members=len(group.members))

    def _cursor(self, group: Group, topic: str, queue: int, from_end: bool,
                from_time: float | None) -> QueueCursor:
        saved = None if group.broadcast else self._offsets.get((group.name, topic, queue))
        if saved is None and from_time is not None:
            saved = first_at(self._store, topic, queue, from_time)
        if saved is None:
            saved = self._store.max_offset(topic, queue) if from_end else self._store.min_offset(topic, queue)
        cursor = self._leases.cursor(topic, queue, saved)
        if not group.broadcast:
            cursor.acked_ahead = self._acked_before.pop((group.name, topic, queue), set())
        return cursor

    # -- offsets ------------------------------------------------------------------------

    def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> bool:
        """Seek the queues ``member`` holds to the given next offsets (offsets kept by the consumer);
        whether the ack journal recorded the seeks (to be synced)."""
        found = self.member(member)
        group = self.group_table[found.group]
        table = found.own if group.broadcast else group.cursors
        for key, offset in offsets.items():
            key = (key[0], int(key[1]))
            if key not in found.queues or key not in table:
                raise DeliveryError(f"member {member!r} does not hold queue {key[0]}/{key[1]}")
            cursor = table[key]
            for held in list(cursor.held):
                self._leases.release(cursor, held)
            cursor.seek(int(offset))
            if not group.broadcast:
                self._offsets.put((group.name, *key), int(offset))
                if self.acks is not None:  # what was acked before no longer counts at a restart
                    self.acks.record((group.name, *key), int(offset))
        return self.acks is not None and not group.broadcast

    def needed(self) -> dict[tuple[str, int], int]:
        """The lowest offset some group still needs per queue, as of the last `save_offsets`
        (the store's retention keeps it)."""
        return dict(self._needed)

    def save_offsets(self) -> None:
        """Record every clustering cursor's committed offset in the book (its file is written by
        the caller, outside the lock) and compact the ack journal when it has grown."""
        clustering = [group for group in self.group_table.values() if not group.broadcast]
        for group in clustering:
            for (topic, queue), cursor in group.cursors.items():
                self._offsets.put((group.name, topic, queue), cursor.committed)
        self._needed = self._offsets.lowest_needed()
        if self.acks is not None and self.acks.size > COMPACT_BYTES:
            self._offsets.flush()  # the committed offsets first: the new journal holds only what is above
            self.acks.compact({**self._acked_before, **{
                (group.name, *key): cursor.done | cursor.acked_ahead
                for group in clustering for key, cursor in group.cursors.items()}})

    # -- inspection -----------------------------------------------------------------------

    def pending(self, group: str, topics: Mapping[str, int]) -> int:
        """Messages of ``topics`` (the broker's, with their queue counts) not yet done by ``group``."""
        found = self.group_table.get(group)
        total = 0
        for topic, count in topics.items():
            for queue in range(count):
                end = self._store.max_offset(topic, queue)
                cursor = found.cursors.get((topic, queue)) if found and not found.broadcast else None
                if cursor is not None:
                    total += cursor.pending(end)
                    continue
                saved = self._offsets.get((group, topic, queue))
                total += end - (saved if saved is not None else self._store.min_offset(topic, queue))
        return total

    def next_due(self, group: str) -> float | None:
        """When the earliest parked (delayed or scheduled) message of ``group`` falls due."""
        found = self.group_table.get(group)
        dues = [d for c in (found.all_cursors() if found else ()) if (d := c.next_due()) is not None]
        return min(dues) if dues else None

    def groups(self) -> list[GroupInfo]:
        return admin.groups(self._offsets, self.group_table)

    def lag(self, group: str) -> list[QueueLag]:
        return admin.lag(self._store, self._offsets, group, self.group_table.get(group))
