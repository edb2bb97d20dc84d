"""The shared KV budget's ledger (extkv.budget.ledger) on made-up numbers:
pure, no device, no clock. Each rule with its numbers, the module's worked
example number by number, illegal calls that raise and change nothing
(against a deep copy of the whole ledger), and a Hypothesis state machine
beside a plain model whose invariant is the budget's accounting: grants
and dead bytes within the budget at every step, no engine above its cap
(or, where engines joined holding more, never more than that, falling as
they give back), nothing held below zero, unique tickets, refused calls
changing nothing (extkv.testing.ledger_machine: the check the planted
ledger defects must fail too)."""

from __future__ import annotations

import math

import pytest
from hypothesis.stateful import run_state_machine_as_test

from extkv.budget import ledger as ledger_module
from extkv.budget.ledger import (
    RECLAIM_DEADLINE_S,
    TICKET_TTL_S,
    Ledger,
    ReclaimIgnored,
    ReserveDenied,
    ShareClaim,
    TicketExpired,
    Verdict,
    fair_shares,
)
from extkv.errors import BudgetProtocolError
from extkv.testing.ledger_machine import ledger_machine, snapshot

pytestmark = [pytest.mark.invariant(5), pytest.mark.budget_proof("ledger")]

GiB = 1 << 30


def engine(ledger: Ledger, name: str):
    return next(status for status in ledger.status() if status.engine == name)


def joined(budget: int, *engines: tuple[str, dict]) -> Ledger:
    ledger = Ledger(budget)
    for pid, (name, terms) in enumerate(engines, start=1):
        ledger.join(name, pid=pid, uid=1000, **{"floor": 0, "cap": None, "weight": 1.0, "now": 0.0, **terms})
    return ledger


def test_constants():
    assert TICKET_TTL_S == 60.0
    assert RECLAIM_DEADLINE_S == 5.0
    assert ledger_module.__doc__ is not None and "Worked example" in ledger_module.__doc__
    assert issubclass(BudgetProtocolError, ValueError)


# --------------------------------------------------------------------------
# fair_shares: water filled by weight, clipped to [floor, cap] and to demand

def claim(weight=1.0, floor=0, cap=1000, demand=1000) -> ShareClaim:
    return ShareClaim(weight, floor, cap, demand)


SHARE_CASES = [
    # (capacity, claims, shares)
    # weights 1:3, nothing binds: level 25 -> 25, 75
    (100, {"a": claim(1), "b": claim(3)}, {"a": 25, "b": 75}),
    # a wants only 10: b takes the rest
    (100, {"a": claim(demand=10), "b": claim()}, {"a": 10, "b": 90}),
    # a's weighted 25 is lifted to its floor 40; b fills to 100
    (100, {"a": claim(1, floor=40), "b": claim(3)}, {"a": 40, "b": 60}),
    # a's weighted 75 is held to its cap 50; b fills to 100
    (100, {"a": claim(3, cap=50), "b": claim(1)}, {"a": 50, "b": 50}),
    # both demands fit: each gets its demand, 30 + 40 < 100
    (100, {"a": claim(demand=30), "b": claim(demand=40)}, {"a": 30, "b": 40}),
    # floors alone exceed the capacity: each keeps its floor
    (100, {"a": claim(floor=60), "b": claim(floor=60)}, {"a": 60, "b": 60}),
    # a floor above the demand counts only the demand: a 10, b 90
    (100, {"a": claim(floor=50, demand=10), "b": claim()}, {"a": 10, "b": 90}),
    # thirds round down: 33 each, 1 byte left
    (100, {"a": claim(), "b": claim(), "c": claim()}, {"a": 33, "b": 33, "c": 33}),
    # the module's example: level 24 -> A 2*24 = 48, B lifted to 30, C its demand 24
    (102, {"A": claim(2, floor=10, cap=102, demand=60), "B": claim(1, floor=30, cap=40, demand=35),
           "C": claim(1, floor=0, cap=102, demand=24)}, {"A": 48, "B": 30, "C": 24}),
    (100, {}, {}),
]


@pytest.mark.parametrize("capacity, claims, shares", SHARE_CASES)
def test_fair_shares(capacity, claims, shares):
    assert fair_shares(capacity, claims) == shares


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("terms, words", [
    (dict(weight=0), "weight must be a finite real number > 0, got 0"),
    (dict(weight=math.inf), "weight must be a finite real number > 0, got inf"),
    (dict(floor=-1), r"floor must be an int >= 0 \(bytes\), got -1"),
    (dict(demand=1.5), r"demand must be an int >= 0 \(bytes\), got 1.5"),
])
def test_a_share_claim_is_checked(terms, words):
    with pytest.raises(BudgetProtocolError, match=words):
        ShareClaim(**{"weight": 1.0, "floor": 0, "cap": 10, "demand": 10, **terms})


# --------------------------------------------------------------------------
# The worked example of the module's docstring, number by number

def worked_example() -> Ledger:
    return joined(102 * GiB, ("A", dict(weight=2, floor=10 * GiB, held=60 * GiB)),
                  ("B", dict(weight=1, floor=30 * GiB, cap=40 * GiB, held=35 * GiB)), ("C", dict(weight=1)))


def test_the_worked_example():
    ledger = worked_example()
    assert ledger.granted == 95 * GiB  # 95 + 24 = 119 > 102: 17 must come back
    demands = {"A": claim(2, 10 * GiB, 102 * GiB, 60 * GiB), "B": claim(1, 30 * GiB, 40 * GiB, 35 * GiB),
               "C": claim(1, 0, 102 * GiB, 24 * GiB)}
    assert fair_shares(102 * GiB, demands) == {"A": 48 * GiB, "B": 30 * GiB, "C": 24 * GiB}

    wait = ledger.reserve("C", 24 * GiB, now=1.0)
    assert wait.verdict == Verdict.WAIT and wait.deadline == 1.0 + RECLAIM_DEADLINE_S
    assert [(r.engine, r.nbytes, r.deadline) for r in wait.reclaims] == [("A", 12 * GiB, 6.0), ("B", 5 * GiB, 6.0)]

    ledger.returned("A", 12 * GiB, now=1.5)
    ledger.released("A", 12 * GiB, now=1.5)  # granted 83; B's pending 5 covers 83 + 24 - 102
    assert ledger.granted == 83 * GiB
    still = ledger.reserve("C", 24 * GiB, now=1.5)
    assert (still.verdict, still.reclaims, still.wait) == (Verdict.WAIT, (), wait.wait)

    ledger.returned("B", 5 * GiB, now=2.0)
    ledger.released("B", 5 * GiB, now=2.0)  # granted 78; 78 + 24 = 102 fits
    granted = ledger.reserve("C", 24 * GiB, now=2.0)
    assert granted.verdict == Verdict.GRANTED
    assert [(s.engine, s.held, s.grant) for s in ledger.status()] == [
        ("A", 48 * GiB, 48 * GiB), ("B", 30 * GiB, 30 * GiB), ("C", 0, 24 * GiB)]
    assert ledger.granted == 102 * GiB and ledger.expire(100.0) == [TicketExpired("C", granted.ticket, 24 * GiB)]


def test_the_worked_example_when_b_ignores_its_reclaim():
    ledger = worked_example()
    wait = ledger.reserve("C", 24 * GiB, now=1.0)
    ledger.returned("A", 12 * GiB, now=1.5)
    ledger.released("A", 12 * GiB, now=1.5)
    assert ledger.expire(5.99) == []
    (ignored, denied) = ledger.expire(6.0)
    assert ignored == ReclaimIgnored("B", wait.reclaims[1].id, 5 * GiB)
    assert denied == ReserveDenied("C", 24 * GiB, wait.wait, "no room for 25769803776 bytes by the reclaim deadline: "
                                   "no answer from B", ("B",))
    assert engine(ledger, "B").reclaims_ignored == 1 and engine(ledger, "B").reclaim_pending_bytes == 0


def test_the_worked_example_when_b_cannot():
    ledger = worked_example()
    ledger.reserve("C", 24 * GiB, now=1.0)
    ledger.returned("A", 12 * GiB, now=1.5)
    ledger.released("A", 12 * GiB, now=1.5)
    ledger.cannot("B", now=1.6)
    denied = ledger.reserve("C", 24 * GiB, now=1.6)  # 83 + 24 - 102 = 5 must come back; A holds its share 48
    assert denied.verdict == Verdict.DENIED
    assert denied.reason == (f"engine 'C' asked {24 * GiB} bytes: budget {102 * GiB}, granted {83 * GiB}, dead 0; "
                             f"{5 * GiB} must come back and engines above their fair shares and floors can give back 0, "
                             "other engines' open tickets hold 0 (not asking again: A, B)")
    assert ledger.expire(100.0) == []  # the wait ended with the denial


# --------------------------------------------------------------------------
# Admission

def test_granted_while_the_budget_and_the_cap_hold():
    ledger = joined(100, ("a", dict(cap=70)), ("b", {}))
    assert ledger.reserve("a", 70, 0.0).verdict == Verdict.GRANTED
    capped = ledger.reserve("a", 1, 0.0)  # 70 + 1 > cap 70, whatever the budget
    assert (capped.verdict, capped.reason) == (Verdict.DENIED, "engine 'a' asked 1 bytes beside its grant of 70: "
                                                               "more than its cap of 70")
    assert ledger.reserve("b", 30, 0.0).verdict == Verdict.GRANTED  # 70 + 30 = 100
    full = ledger.reserve("b", 1, 0.0)  # a's 70 are an open ticket, in flight: nothing to reclaim, its settling awaited
    assert (full.verdict, full.reclaims) == (Verdict.WAIT, ())


def test_a_cap_above_the_budget_is_the_budget():
    ledger = joined(100, ("a", dict(cap=10**12)))
    assert engine(ledger, "a").cap == 100


def test_dead_bytes_count_until_seen_gone():
    ledger = joined(100, ("a", dict(held=60)), ("b", {}))
    ledger.leave("a", 1.0)
    assert (engine(ledger, "a").lease, engine(ledger, "a").dead, ledger.granted, ledger.dead) == ("dead", 60, 0, 60)
    denied = ledger.reserve("b", 41, 1.0)  # 60 dead + 41 > 100, and no live engine to reclaim from
    assert denied.verdict == Verdict.DENIED and "dead 60" in denied.reason
    assert ledger.reserve("b", 40, 1.0).verdict == Verdict.GRANTED
    ledger.seen_gone("a", 20, 2.0)  # the reading shows 20 left
    assert engine(ledger, "a").dead == 20
    assert ledger.reserve("b", 41, 2.0).verdict == Verdict.DENIED  # 40 + 20 + 41 > 100
    assert ledger.reserve("b", 40, 2.0).verdict == Verdict.GRANTED
    ledger.seen_gone("a", 30, 3.0)  # a reading above the dead bytes does not raise them
    assert engine(ledger, "a").dead == 20
    ledger.seen_gone("a", 0, 4.0)
    assert [s.engine for s in ledger.status()] == ["b"] and ledger.dead == 0
    assert ledger.reserve("b", 20, 4.0).verdict == Verdict.GRANTED


def test_a_lease_that_held_nothing_is_forgotten_at_once():
    ledger = joined(100, ("a", {}))
    ledger.leave("a", 1.0)
    assert ledger.status() == []
    ledger.join("a", pid=7, uid=1000, floor=0, cap=None, weight=1.0, now=2.0)  # the name is free again


def test_a_rejoin_holding_more_than_is_left_is_counted_and_growth_waits_for_room():
    """Engines rejoin a restarted daemon: a holding 30 of a budget of 100,
    b holding 90 under a cap of 60. All 120 are counted, the excess is in
    the status, and nothing is granted past the cap or the budget until
    bytes come back: b, 30 above its share, is asked for them."""
    ledger = joined(100, ("a", dict(held=30)), ("b", dict(held=90, cap=60)))
    assert (ledger.granted, ledger.over_budget) == (120, 20)
    assert [(s.engine, s.held, s.over_cap) for s in ledger.status()] == [("a", 30, 0), ("b", 90, 30)]
    capped = ledger.reserve("b", 1, 0.0)
    assert capped.verdict == Verdict.DENIED and "more than its cap of 60" in capped.reason
    wait = ledger.reserve("a", 10, 0.0)  # shares of demands 40, 90 (capped at 60): 40, 60
    assert wait.verdict == Verdict.WAIT and [(r.engine, r.nbytes) for r in wait.reclaims] == [("b", 30)]
    ledger.returned("b", 30, 0.5)
    ledger.released("b", 30, 0.5)
    assert ledger.reserve("a", 10, 0.5).verdict == Verdict.GRANTED
    assert (ledger.granted, ledger.over_budget, engine(ledger, "b").over_cap) == (100, 0, 0)


def test_a_leaving_engine_takes_its_tickets_into_dead_bytes():
    ledger = joined(100, ("a", dict(held=10)))
    ledger.reserve("a", 30, 0.0)
    ledger.leave("a", 1.0)
    assert engine(ledger, "a").dead == 40


# --------------------------------------------------------------------------
# Tickets

def test_confirm_keeps_what_was_created_and_gives_back_the_rest():
    ledger = joined(100, ("a", {}))
    first, second = ledger.reserve("a", 40, 0.0).ticket, ledger.reserve("a", 30, 0.0).ticket
    assert first != second
    assert (engine(ledger, "a").grant, engine(ledger, "a").open_tickets) == (70, 2)
    ledger.confirm("a", first, 25, 1.0)
    assert (engine(ledger, "a").held, engine(ledger, "a").grant) == (25, 55)
    ledger.cancel("a", second, 1.0)
    assert (engine(ledger, "a").held, engine(ledger, "a").grant, engine(ledger, "a").open_tickets) == (25, 25, 0)


def test_an_expired_ticket_counts_as_held_until_settled():
    ledger = joined(100, ("a", {}))
    ticket = ledger.reserve("a", 40, 10.0).ticket
    assert ledger.expire(10.0 + TICKET_TTL_S - 0.01) == []
    assert ledger.expire(10.0 + TICKET_TTL_S) == [TicketExpired("a", ticket, 40)]
    status = engine(ledger, "a")
    assert (status.held, status.grant, status.open_tickets, status.expired_tickets) == (40, 40, 0, 1)
    assert ledger.expire(1000.0) == []  # expired once
    ledger.confirm("a", ticket, 10, 1000.0)  # late: the 30 not created come back
    assert (engine(ledger, "a").held, engine(ledger, "a").expired_tickets) == (10, 0)


def test_returning_more_than_held_is_clamped_and_noted():
    ledger = joined(100, ("a", dict(held=10)))
    ledger.returned("a", 15, 1.0)
    assert (engine(ledger, "a").held, engine(ledger, "a").overclaimed_bytes) == (0, 5)


# --------------------------------------------------------------------------
# Reclaims

def test_reclaims_ask_only_what_is_above_the_share():
    ledger = joined(100, ("a", dict(held=70)), ("b", {}))
    wait = ledger.reserve("b", 50, 0.0)  # shares of demands 70, 50: 50 each; 70 + 50 - 100 = 20 from a
    assert [(r.engine, r.nbytes) for r in wait.reclaims] == [("a", 20)]
    assert engine(ledger, "a").reclaim_pending_bytes == 20


def test_an_engine_at_its_floor_is_never_asked():
    ledger = joined(100, ("a", dict(held=50, floor=50, weight=0.01)), ("b", dict(held=10)))
    denied = ledger.reserve("b", 60, 0.0)  # a's weighted share is tiny, but 50 is its floor
    assert denied.verdict == Verdict.DENIED and "can give back 0" in denied.reason


def test_a_reclaim_stops_at_the_share_or_at_the_floor_above_it():
    ledger = joined(100, ("a", dict(held=60, floor=45)), ("b", {}))
    wait = ledger.reserve("b", 50, 0.0)  # shares of demands 60, 50: 50 each, above a's floor: a gives 10
    assert [(r.engine, r.nbytes) for r in wait.reclaims] == [("a", 10)]
    ledger = joined(100, ("a", dict(held=60, floor=55)), ("b", {}))
    denied = ledger.reserve("b", 50, 0.0)  # a's floor lifts its share to 55 (b's: 45): a can give 5, 10 are needed
    assert denied.verdict == Verdict.DENIED and "10 must come back" in denied.reason and "give back 5" in denied.reason


def test_open_tickets_do_not_let_a_reclaim_take_held_bytes_below_the_floor():
    ledger = joined(100, ("a", dict(held=50, floor=50)), ("b", {}))
    ticket = ledger.reserve("a", 40, 0.0).ticket  # a's grant 90, of it 50 held: its floor
    waits = ledger.reserve("b", 30, 0.0)  # shares of demands 90, 30: 70, 30; a's 20 above it are in flight
    assert (waits.verdict, waits.reclaims) == (Verdict.WAIT, ())  # no held byte below the floor is asked
    ledger.confirm("a", ticket, 40, 0.5)  # created: a holds 90, 20 above its share
    asked = ledger.reserve("b", 30, 0.5)
    assert (asked.verdict, asked.wait) == (Verdict.WAIT, waits.wait)
    assert [(r.engine, r.nbytes) for r in asked.reclaims] == [("a", 20)]


def test_an_asker_above_its_share_takes_nothing_from_others():
    ledger = joined(100, ("a", dict(held=60)), ("b", dict(held=40)))
    denied = ledger.reserve("a", 20, 0.0)  # shares of demands 80, 40: 60, 40; b holds its share
    assert denied.verdict == Verdict.DENIED and "can give back 0" in denied.reason


def test_open_tickets_are_not_reclaimed():
    ledger = joined(100, ("a", dict(held=10)), ("b", {}))
    ticket = ledger.reserve("a", 60, 0.0).ticket  # a's grant 70, of it 10 held
    waits = ledger.reserve("b", 50, 0.0)  # 20 above a's share, in flight: the ticket's settling is awaited
    assert (waits.verdict, waits.reclaims) == (Verdict.WAIT, ())
    ledger.confirm("a", ticket, 60, 0.5)  # created: now held, and a holds 20 above its share
    asked = ledger.reserve("b", 50, 0.5)
    assert [(r.engine, r.nbytes) for r in asked.reclaims] == [("a", 20)]


def test_a_reserve_short_by_others_open_tickets_waits_for_their_settling():
    """What must come back is in another engine's open ticket, which a
    create that fails or makes less gives back: the reserve waits, asking
    no one, and each settling runs it again, as the daemon does."""
    def waiting() -> tuple[Ledger, int, int]:
        ledger = joined(100, ("a", dict(floor=70)), ("b", {}))
        ticket = ledger.reserve("a", 70, 0.0).ticket  # nothing held above a's floor: nothing to reclaim
        assert ledger.reserve("b", 20, 0.0).verdict == Verdict.GRANTED
        wait = ledger.reserve("b", 20, 0.0)  # 10 must come back; a's 70 are in flight
        assert (wait.verdict, wait.reclaims, wait.deadline) == (Verdict.WAIT, (), RECLAIM_DEADLINE_S)
        return ledger, ticket, wait.wait

    ledger, ticket, wait = waiting()
    ledger.cancel("a", ticket, 0.5)  # the create failed: all of it back
    assert ledger.reserve("b", 20, 0.5).verdict == Verdict.GRANTED
    ledger, ticket, wait = waiting()
    ledger.confirm("a", ticket, 60, 0.5)  # 10 not created: back, and room enough
    assert ledger.reserve("b", 20, 0.5).verdict == Verdict.GRANTED
    ledger, ticket, wait = waiting()
    ledger.confirm("a", ticket, 70, 0.5)  # all created: no room, nothing in flight, denied at once
    denied = ledger.reserve("b", 20, 0.5)
    assert (denied.verdict, denied.reason) == (Verdict.DENIED, (
        "engine 'b' asked 20 bytes: budget 100, granted 90, dead 0; 10 must come back and engines above their fair "
        "shares and floors can give back 0, other engines' open tickets hold 0"))
    assert [event for event in ledger.expire(100.0) if isinstance(event, ReserveDenied)] == []  # the wait ended
    ledger, ticket, wait = waiting()
    assert ledger.reserve("b", 20, 1.0).wait == wait  # run again before a settles: the same wait
    (denied,) = [event for event in ledger.expire(RECLAIM_DEADLINE_S) if isinstance(event, ReserveDenied)]
    assert denied == ReserveDenied("b", 20, wait, "no room for 20 bytes by the reclaim deadline: the reclaims and "
                                   "the creates under way did not free enough", ())


def test_an_engine_asked_to_give_back_does_not_wait_on_open_tickets():
    ledger = joined(100, ("a", dict(held=60)), ("b", {}), ("c", dict(floor=30)))
    ticket = ledger.reserve("c", 30, 0.0).ticket  # c's 30 in flight, at its floor
    asked = ledger.reserve("b", 20, 0.0)  # 10 must come back: a, above its share, is asked
    assert [(r.engine, r.nbytes) for r in asked.reclaims] == [("a", 10)]
    denied = ledger.reserve("a", 15, 0.0)  # c's ticket could cover the 5 short, but a must answer first
    assert denied.verdict == Verdict.DENIED and "5 must come back" in denied.reason
    assert "other engines' open tickets hold 30" in denied.reason
    ledger.released("a", 0, 0.5)
    assert ledger.reserve("a", 15, 0.5).verdict == Verdict.WAIT  # answered: it may wait on c's ticket
    ledger.cancel("c", ticket, 0.6)
    assert ledger.reserve("a", 15, 0.6).verdict == Verdict.GRANTED


def test_a_leaving_engine_ends_its_waits_and_the_reclaims_asked_of_it():
    ledger = joined(100, ("a", dict(held=70)), ("b", {}))
    ledger.reserve("b", 50, 0.0)
    ledger.leave("a", 1.0)
    assert engine(ledger, "a").reclaim_pending_bytes == 0
    (denied,) = ledger.expire(RECLAIM_DEADLINE_S)
    assert denied.reason.endswith("the reclaims and the creates under way did not free enough") and denied.ignored == ()
    ledger = joined(100, ("a", dict(held=70)), ("b", {}))
    ledger.reserve("b", 50, 0.0)
    ledger.leave("b", 1.0)
    assert [event.engine for event in ledger.expire(RECLAIM_DEADLINE_S)] == ["a"]  # only a's reclaim, no wait


def test_a_reserve_waiting_on_an_engine_that_dies_waits_for_its_bytes_seen_gone():
    """The engine asked to reclaim dies before it answers: the reserve run
    again (as the daemon does at the lease's end) keeps waiting, for the
    dead bytes, and is granted once they are seen gone; a reserve not yet
    waiting is denied at once, as dead bytes are no one's to reclaim."""
    ledger = joined(100, ("a", dict(held=70)), ("b", {}))
    wait = ledger.reserve("b", 50, 0.0)
    ledger.leave("a", 1.0)
    still = ledger.reserve("b", 50, 1.0)
    assert (still.verdict, still.reclaims, still.wait, still.deadline) == (Verdict.WAIT, (), wait.wait, wait.deadline)
    assert ledger.reserve("b", 40, 1.0).verdict == Verdict.DENIED
    ledger.seen_gone("a", 0, 1.02)
    assert ledger.reserve("b", 50, 1.02).verdict == Verdict.GRANTED and ledger.expire(RECLAIM_DEADLINE_S) == []


def test_an_engine_whose_own_reserve_waits_is_never_asked():
    """A waits, inside a commit that holds its cache's lock, so it could not
    shrink: when another engine's death leaves A above its share of what
    remains, C's reserve does not ask A, and is denied at once."""
    ledger = joined(400, ("a", dict(held=200)), ("b", dict(held=200, floor=50, weight=0.5)), ("c", {}))
    assert [(r.engine, r.nbytes) for r in ledger.reserve("a", 50, 0.0).reclaims] == [("b", 50)]
    ledger.leave("b", 0.1)  # b's 200 bytes are dead until seen gone; a waits on for them
    denied = ledger.reserve("c", 50, 0.2)  # shares of the 200 left: a 150, c 50; a is 50 above its share
    assert denied.verdict == Verdict.DENIED and "can give back 0" in denied.reason, denied
    assert engine(ledger, "a").reclaim_pending_bytes == 0


def test_an_engine_asked_to_give_back_may_not_begin_a_wait():
    """B, asked for 5 bytes, reserves before it answers (its commit was
    under way): waiting, it would hold its cache's lock and never answer, so
    the reserve is denied at once and changes nothing; once it answered it
    may wait as any engine."""
    ledger = joined(100, ("a", {}), ("b", dict(held=40)), ("c", dict(held=60)))
    asked = ledger.reserve("a", 30, 0.0)  # shares of demands 30, 40, 60: 30, 35, 35
    assert sorted((r.engine, r.nbytes) for r in asked.reclaims) == [("b", 5), ("c", 25)]
    before = snapshot(ledger)
    denied = ledger.reserve("b", 10, 0.1)  # 100 + 10 > 100: it would wait on c's reclaim
    assert denied.verdict == Verdict.DENIED and "not answered a reclaim of 5 bytes" in denied.reason, denied
    assert snapshot(ledger) == before
    ledger.cannot("b", 0.2)
    assert ledger.reserve("b", 10, 0.2).verdict == Verdict.WAIT


def test_a_late_answer_is_no_error():
    ledger = joined(100, ("a", dict(held=70)), ("b", {}))
    ledger.reserve("b", 50, 0.0)
    ledger.expire(RECLAIM_DEADLINE_S)
    ledger.returned("a", 20, 6.0)
    ledger.released("a", 20, 6.0)
    ledger.cannot("a", 6.0)
    assert engine(ledger, "a").held == 50


# --------------------------------------------------------------------------
# Illegal calls raise, naming the value and what was expected, and change nothing

def busy_ledger() -> Ledger:
    """Two live engines with open, expired and closed tickets, a wait, a
    pending reclaim and a dead lease: every kind of state a call can change."""
    ledger = joined(1000, ("a", dict(held=600, floor=100)), ("b", dict(held=50)), ("d", dict(held=30)))
    ledger.reserve("a", 10, 0.0)  # ticket 1, expires
    ledger.expire(TICKET_TTL_S)
    ledger.reserve("a", 20, TICKET_TTL_S)  # ticket 2, closed below
    ledger.confirm("a", 2, 20, TICKET_TTL_S)
    ledger.reserve("b", 5, TICKET_TTL_S)  # ticket 3, open
    ledger.leave("d", TICKET_TTL_S)
    assert ledger.reserve("b", 400, TICKET_TTL_S).verdict == Verdict.WAIT
    return ledger


def joining(name: str, **terms):
    """A join of `name` with `terms` over good defaults."""
    return lambda ledger: ledger.join(name, **{"pid": 9, "uid": 1, "floor": 0, "cap": None, "weight": 1.0, "now": 61.0,
                                               **terms})


ILLEGAL_CALLS = [
    # (call, the error's words)
    (lambda l: l.reserve("x", 10, 61.0), "reserve: engine 'x' is absent, expected live"),
    (lambda l: l.reserve("", 10, 61.0), "engine must be a non-empty str, got ''"),
    (lambda l: l.returned(7, 10, 61.0), "engine must be a non-empty str, got 7"),
    (joining("a"), "join: engine 'a' is live, expected absent"),
    (joining("d"), "join: engine 'd' is dead, expected absent"),
    (lambda l: l.reserve("d", 10, 61.0), "reserve: engine 'd' is dead, expected live"),
    (lambda l: l.leave("d", 61.0), "leave: engine 'd' is dead, expected live"),
    (lambda l: l.seen_gone("a", 0, 61.0), "seen_gone: engine 'a' is live, expected dead"),
    (lambda l: l.confirm("a", 99, 1, 61.0), r"confirm: ticket must be one of engine 'a'.s tickets \[1\], got 99 "
                                            r"\(never issued\)"),
    (lambda l: l.confirm("a", 2, 1, 61.0), r"ticket must be one of engine 'a'.s tickets \[1\], got 2 \(closed, or no ticket\)"),
    (lambda l: l.cancel("a", 3, 61.0), r"cancel: ticket must be one of engine 'a'.s tickets \[1\], got 3 \(engine 'b'.s\)"),
    (lambda l: l.confirm("b", 3, 6, 61.0), "created must be <= the ticket's 5 bytes, got 6"),
    (lambda l: l.confirm("b", 3, -1, 61.0), r"created must be an int >= 0 \(bytes\), got -1"),
    (lambda l: l.confirm("b", True, 1, 61.0), r"ticket must be an int >= 1 \(a ticket id\), got True"),
    (lambda l: l.reserve("a", 0, 61.0), r"nbytes must be an int >= 1 \(bytes\), got 0"),
    (lambda l: l.reserve("a", 2.5, 61.0), r"nbytes must be an int >= 1 \(bytes\), got 2.5"),
    (lambda l: l.returned("a", -1, 61.0), r"nbytes must be an int >= 0 \(bytes\), got -1"),
    (lambda l: l.released("a", -1, 61.0), r"nbytes must be an int >= 0 \(bytes\), got -1"),
    (lambda l: l.reserve("a", 10, math.nan), "now must be a finite real number, got nan"),
    (lambda l: l.returned("a", 10, "61"), "now must be a finite real number, got '61'"),
    (lambda l: l.expire(math.inf), "now must be a finite real number, got inf"),
    (lambda l: l.seen_gone("d", 1.5, 61.0), r"outside_bytes must be an int \(bytes\), got 1.5"),
    (joining("e", pid=0), r"pid must be an int >= 1 \(a process id\), got 0"),
    (joining("e", uid=-1), r"uid must be an int >= 0 \(a user id\), got -1"),
    (joining("e", weight=0.0), "weight must be a finite real number > 0, got 0.0"),
    (joining("e", weight=True), "weight must be a finite real number > 0, got True"),
    (joining("e", cap=0), r"cap must be an int >= 1 \(bytes\), got 0"),
    (joining("e", floor=20, cap=10), "floor must be <= the cap of 10 bytes, got 20"),
    (joining("e", floor=901), r"floor must be <= 900 bytes, what the budget of 1000 leaves beside the other floors \(100\), got 901"),
    (joining("e", held=-1), r"held must be an int >= 0 \(bytes\), got -1"),
]


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("call, words", ILLEGAL_CALLS, ids=[words[:50] for _, words in ILLEGAL_CALLS])
def test_an_illegal_call_raises_and_changes_nothing(call, words):
    ledger = busy_ledger()
    before = snapshot(ledger)
    with pytest.raises(BudgetProtocolError, match=words):
        call(ledger)
    assert snapshot(ledger) == before


@pytest.mark.invariant(5, 6)
def test_a_fresh_denial_changes_nothing():
    ledger = busy_ledger()
    before = snapshot(ledger)
    assert ledger.reserve("b", 951, 61.0).verdict == Verdict.DENIED  # above b's cap (the budget)
    assert ledger.reserve("a", 300, 61.0).verdict == Verdict.DENIED  # others hold at most their shares
    assert snapshot(ledger) == before


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("budget", [0, -1, True, 1.0, None])
def test_a_budget_must_be_a_positive_int(budget):
    with pytest.raises(BudgetProtocolError, match=rf"budget must be an int >= 1 \(bytes\), got {budget!r}"):
        Ledger(budget)


# --------------------------------------------------------------------------
# The state machine, beside a plain model (extkv.testing.ledger_machine)

def test_ledger_state_machine():
    run_state_machine_as_test(ledger_machine())


def test_bytes_ahead_come_only_from_room_free_now_and_within_the_cap():
    ledger = joined(100, ("a", {}), ("b", dict(cap=40)), ("c", dict(held=30)))
    first = ledger.reserve("a", 20, 0.0, ahead=30)
    assert (first.verdict, first.nbytes) == (Verdict.GRANTED, 50)  # 30 + 50 granted of 100
    second = ledger.reserve("b", 10, 0.0, ahead=50)
    assert (second.verdict, second.nbytes) == (Verdict.GRANTED, 20)  # 10 free past it; its cap would allow 30
    assert ledger.granted == 100 and engine(ledger, "b").open_ticket_bytes == 20
    ledger.confirm("a", first.ticket, 35, 0.1)  # 20 created, 15 kept ahead as held: 15 go back
    assert (engine(ledger, "a").held, ledger.granted) == (35, 85)
    capped = joined(100, ("b", dict(cap=40))).reserve("b", 10, 0.0, ahead=50)
    assert capped.nbytes == 40  # 90 free, its cap leaves 30


def test_no_bytes_ahead_while_a_reserve_waits():
    ledger = joined(100, ("a", dict(held=70)), ("b", {}), ("c", {}))
    waits = ledger.reserve("b", 40, 0.0)  # 10 must come back from a
    assert waits.verdict == Verdict.WAIT
    meanwhile = ledger.reserve("c", 10, 0.0, ahead=20)  # fits, but the room is the wait's
    assert (meanwhile.verdict, meanwhile.nbytes) == (Verdict.GRANTED, 10)
    assert [type(event) for event in ledger.expire(RECLAIM_DEADLINE_S)] == [ReclaimIgnored, ReserveDenied]
    after = ledger.reserve("c", 5, RECLAIM_DEADLINE_S, ahead=20)
    assert (after.verdict, after.nbytes) == (Verdict.GRANTED, 20)  # 15 free past it


@pytest.mark.invariant(5, 6)
@pytest.mark.parametrize("ahead, words", [(-1, "ahead must be an int >= 0"), (1.5, "ahead must be an int >= 0"),
                                          (True, "ahead must be an int >= 0")])
def test_bad_ahead_is_refused_and_changes_nothing(ahead, words):
    ledger = joined(100, ("a", {}))
    before = snapshot(ledger)
    with pytest.raises(BudgetProtocolError, match=words):
        ledger.reserve("a", 10, 0.0, ahead=ahead)
    assert snapshot(ledger) == before
