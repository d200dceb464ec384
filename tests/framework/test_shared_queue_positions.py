"""Two members of a group on a leasing transport save where the group stands, not where each stood.

A leasing transport (memory, Redis Streams) gives every member every queue: a member's own done
offsets stop at the first offset another member took, so its saved position (the offsets saved
with the tokens, `commit="transactional"`) stayed there for as long as the pair ran, and a
restart sought the group back to it and read everything again (skipped by the tokens). Measured
with 300 messages over 4 queues, two members taking turns: 292 read again after a stop on memory
and on Redis Streams before; none after. The position follows what the group as a whole finished
(`LeasingSubscription.finished_below`), which a message still leased to a member holds back, dead or
alive: killed with messages in hand, the member's messages come again after the restart and the
rest is not read again past them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reliable import App
from reliable.commit import Transactional
from reliable.testing import test_app
from reliable.worker import Worker
from tests.contract.transports import LEASING, TRANSPORTS

MESSAGES, PREFETCH = 300, 3  # over the transports' 4 queues


@pytest.fixture(params=LEASING)
def app(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[App]:
    url, _ = TRANSPORTS[request.param](request, tmp_path, unique)
    app = test_app(tmp_path, transport=url, settings={"RELIABLE_WORKER__PREFETCH": str(PREFETCH),
                                                      "RELIABLE_RETRY__IN_PROCESS_ATTEMPTS": "1"})
    yield app
    if hasattr(app.transport, "purge"):
        app.transport.purge()
    app.close()


class Billing:
    """Group ``billing``'s handler, recording each message it finished; `member` joins the group."""

    def __init__(self, app: App) -> None:
        self.app, self.done, self.failing = app, list[int](), set[int]()

        @app.handler("orders", group="billing", token="body.n")
        def bill(msg, tx) -> None:  # type: ignore[no-untyped-def]
            if msg.body["n"] in self.failing:
                self.failing.discard(msg.body["n"])
                raise ConnectionError("down for a moment")  # retryable: handed back with a delay
            self.done.append(msg.body["n"])

        bill.config = app.config_for(bill)
        self.handler = bill

    def member(self) -> Worker:
        return Worker(self.handler, self.app.runtime, Transactional())


def take_turns(members: list[Worker]) -> list[int]:
    """Poll the members in turn until none fetches anything: each fetch leaves gaps for the other."""
    taken = [0] * len(members)
    fetched = [member.poll(0) for member in members]
    while any(fetched):
        taken = [total + count for total, count in zip(taken, fetched)]
        fetched = [member.poll(0) for member in members]
    return taken


def read_alone(member: Worker) -> int:
    """Messages ``member`` fetches until none is left."""
    read = 0
    while fetched := member.poll(0):
        read += fetched
    return read


def saved(app: App) -> dict[int, int]:
    return {ref.queue: offset for ref, offset in app.store.load_offsets("billing").items() if ref.topic == "orders"}


def test_a_restarted_group_reads_again_only_what_it_had_not_finished(app: App) -> None:
    billing = Billing(app)
    done = billing.done
    app.publish_many("orders", [{"n": n} for n in range(MESSAGES)])
    members = [billing.member(), billing.member()]
    taken = take_turns(members)
    for member in members:
        member.close()
    assert sum(taken) == MESSAGES and min(taken) >= MESSAGES // 3, taken  # both read every queue
    assert sum(saved(app).values()) == MESSAGES  # every queue saved at its end: 292 short before

    again = billing.member()
    assert read_alone(again) == 0  # read again after the restart: 292 before
    again.close()
    assert sorted(done) == list(range(MESSAGES))


def test_a_killed_members_messages_come_again_and_bound_what_is_read_again(app: App) -> None:
    billing = Billing(app)
    done = billing.done
    app.publish_many("orders", [{"n": n} for n in range(MESSAGES)])
    killed, survivor = billing.member(), billing.member()
    while len(done) < 2 * MESSAGES // 3:  # both members finish two thirds, in turns
        killed.poll(0)
        survivor.poll(0)
    held = killed.subscription.fetch(killed.fetch_size, 0)  # then one dies with these in hand
    assert held and killed.watermark is not None
    killed.watermark.fetched(held)  # as its poll did before the kill: never settled, never closed
    read_before = len(done) + len(held)
    assert read_alone(survivor) == MESSAGES - read_before  # the survivor finishes the rest...
    survivor.close()
    lowest = {queue: min(m.offset for m in held if m.queue == queue) for queue in {m.queue for m in held}}
    assert all(saved(app)[queue] <= offset for queue, offset in lowest.items())  # ...never saved past the dead
    assert not {m.body["n"] for m in held} & set(done)  # its messages are still not done, their leases held

    again = billing.member()
    read_again = read_alone(again)
    again.close()
    assert sorted(set(done)) == list(range(MESSAGES))  # nothing lost
    assert len(done) == MESSAGES  # nothing done twice
    # read again: its messages, and what the survivor read alone after them (on their queues);
    # the whole topic before
    assert len(held) <= read_again <= MESSAGES - read_before + len(held) + 2 * PREFETCH, read_again


def test_a_redelivery_a_killed_member_held_below_the_saved_position_comes_again(app: App) -> None:
    """A message handed back (nacked) waits in the transport, so the position passes it; claimed
    again and in the hands of a member that dies, the restart's seek forgot it as done before."""
    billing = Billing(app)
    billing.failing.add(0)
    app.publish_many("orders", [{"n": n} for n in range(2 * PREFETCH)], key="same")  # one queue
    killed = billing.member()
    while killed.poll(0):
        pass
    assert sorted(billing.done) == list(range(1, 2 * PREFETCH)) and killed.pending() == 1  # 0 waits
    assert sum(saved(app).values()) == 2 * PREFETCH  # saved past it
    app.runtime.clock.advance(3600)  # type: ignore[attr-defined]  # its delay passed
    held = killed.subscription.fetch(killed.fetch_size, 0)  # the member dies with it in hand
    assert [(m.body["n"], m.attempt) for m in held] == [(0, 2)]

    again = billing.member()
    assert read_alone(again) == 0  # its lease holds it: nothing read again
    app.runtime.clock.advance(3600)  # type: ignore[attr-defined]  # the dead member's lease ended
    assert read_alone(again) == 1 and again.pending() == 0
    again.close()
    assert sorted(billing.done) == list(range(2 * PREFETCH))  # 0 was lost before


def test_a_survivor_that_finished_a_killed_members_messages_saves_the_end(app: App) -> None:
    """The killed member held a message nacked early on (the position had passed it, as it waited
    in the transport) with messages it finished above it: once its leases ended the survivor
    finished it last, and its own done offsets ran into the ones the killed member had finished."""
    billing = Billing(app)
    billing.failing.add(5)
    app.publish_many("orders", [{"n": n} for n in range(MESSAGES)])
    killed, survivor = billing.member(), billing.member()
    while len(billing.done) < MESSAGES // 2:
        killed.poll(0)
        survivor.poll(0)
    killed.poll(0)  # its last messages done, the survivor has not fetched since
    app.runtime.clock.advance(3600)  # type: ignore[attr-defined]  # the nacked message is due
    held = killed.subscription.fetch(killed.fetch_size, 0)  # the killed member dies with it in hand
    assert 5 in [m.body["n"] for m in held]
    read_alone(survivor)
    app.runtime.clock.advance(3600)  # type: ignore[attr-defined]  # the dead member's leases end
    assert read_alone(survivor) == len(held)
    survivor.close()
    assert sorted(billing.done) == list(range(MESSAGES))
    assert sum(saved(app).values()) == MESSAGES

    again = billing.member()
    assert read_alone(again) == 0
    again.close()
