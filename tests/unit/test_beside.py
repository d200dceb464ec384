"""`call_beside`: the call's use of ``tx`` waits for the claim; the claim's failure wins; an
interrupt stays an interrupt, and the helper is off the connection before anything returns."""

from __future__ import annotations

import threading

import pytest

from reliable.spark.beside import LostBet, call_beside


class Tx:
    """Records who used it, and whether the claim had ended by then."""

    def __init__(self) -> None:
        self.claim_done = threading.Event()
        self.used_after_claim: list[bool] = []

    def execute(self) -> str:
        self.used_after_claim.append(self.claim_done.is_set())
        return "executed"


def test_the_call_uses_tx_only_after_the_claim_and_gets_its_result():
    tx, call_started = Tx(), threading.Event()

    def claim() -> set[str]:
        assert call_started.wait(10)  # the call runs while the claim does
        tx.claim_done.set()
        return {"a", "b"}

    def call(guarded) -> None:
        call_started.set()
        assert guarded.execute() == "executed"

    assert call_beside(call, tx, claim, "test-claim") == {"a", "b"}
    assert tx.used_after_claim == [True]


def test_a_lost_bet_wins_over_the_calls_own_error_even_when_swallowed():
    tx = Tx()

    def claim() -> set[str]:
        raise LostBet("1 token already recorded")

    def swallowing(guarded) -> None:
        try:
            guarded.execute()
        except LostBet:
            pass

    def wrapping(guarded) -> None:
        try:
            guarded.execute()
        except LostBet as exc:
            raise RuntimeError("the sink failed") from exc

    for call in (swallowing, wrapping):
        with pytest.raises(LostBet, match="already recorded"):
            call_beside(call, tx, claim, "test-claim")
    assert tx.used_after_claim == []  # the lost bet stopped every use of tx


def test_the_calls_error_stands_when_the_claim_succeeded():
    def call(guarded) -> None:
        raise ValueError("bad row")

    with pytest.raises(ValueError, match="bad row"):
        call_beside(call, Tx(), lambda: {"a"}, "test-claim")


def test_an_interrupt_stays_an_interrupt_once_the_claim_has_ended():
    ended = threading.Event()

    def claim() -> set[str]:
        ended.wait(0.2)
        ended.set()
        raise LostBet("the bet is lost too")

    def call(guarded) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_beside(call, Tx(), claim, "test-claim")
    assert ended.is_set()
