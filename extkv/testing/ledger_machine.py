"""The ledger of the shared KV budget (extkv.budget.ledger) driven by Hypothesis beside a plain model.

Theory of operation
-------------------
`LedgerMachine` is a Hypothesis state machine: legal calls on engines
drawn from a plain model of what the ledger should hold by its rules
alone, and illegal ones that must raise and change nothing (against a deep
copy of the whole ledger). What it checks at every step is the budget's
accounting: grants and dead bytes within the budget, a reserve granted
exactly when it fits the budget and the engine's cap, no engine above its
cap (where joins brought more than either, as engines rejoining a daemon
that restarted do, never more than they brought, falling as they give
back), nothing held below zero, unique tickets, every reclaim asked of a
live engine above its floor and never of an engine whose own reserve
waits, no wait begun by an engine asked to give back, the reclaims
pending and other engines' open tickets enough for what a waiting reserve
needs, no denial of a reserve that those tickets alone could make room for,
and the ledger's numbers per engine equal to the model's. Answers to
reclaims and settled tickets run the waiting reserves again, as the daemon
does.

The machine lives here, not in its test module, so that the contract test
(conformance/test_budget_ledger.py) and the planted ledger defects
(extkv.testing.planted, conformance/test_planted_defects.py) run the same
check: `ledger_machine(make_ledger)` is the machine over the ledgers
`make_ledger(budget)` builds. Every assertion names its numbers.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..budget.ledger import RECLAIM_DEADLINE_S, TICKET_TTL_S, Decision, Ledger, ReserveDenied, TicketExpired, Verdict
from ..errors import BudgetProtocolError


def snapshot(ledger: Ledger) -> dict:
    """Everything the ledger holds, deep-copied: equal before and after a
    call that changed nothing."""
    return copy.deepcopy(vars(ledger))


#: The budget of every run: small numbers read well in a failure.
BUDGET = 1000
NAMES = ("a", "b", "c")
#: Bytes an engine holds as it joins: often a large share of the budget, so
#: that it fills soon; and bytes a reserve asks, a few shares of it.
HELD_BYTES = st.integers(0, 450) | st.sampled_from([150, 300, 450])
ASKED_BYTES = st.integers(1, 200) | st.sampled_from([50, 100, 200])


@dataclass
class ModelEngine:
    """What the ledger should hold for one engine, by the rules alone."""

    floor: int
    cap: int
    live: bool = True
    held: int = 0
    dead: int = 0
    open: dict[int, tuple[int, float]] = field(default_factory=dict)  # ticket -> (bytes, issued at)
    expired: dict[int, int] = field(default_factory=dict)  # ticket -> bytes
    ceiling: int = 0  # the most its grant may be: its cap, or what it joined holding until it falls below that

    @property
    def grant(self) -> int:
        return self.held + sum(nbytes for nbytes, _ in self.open.values())


class LedgerMachine(RuleBasedStateMachine):
    """Legal calls on engines drawn from the model; `illegal` makes the
    refused ones. Answers to reclaims and settled tickets run the waiting
    reserves again, as the daemon does. `make_ledger(budget)` builds the
    ledger under test."""

    make_ledger: Callable[[int], Ledger] = Ledger

    def __init__(self):
        super().__init__()
        self.ledger = self.make_ledger(BUDGET)
        self.model: dict[str, ModelEngine] = {}
        self.now = 0.0
        self.issued: set[int] = set()
        self.waiting: set[tuple[str, int]] = set()  # reserves told to wait, not yet answered
        #: The most the grants and dead bytes may add up to: the budget, or
        #: what joins holding more than was left made it, until it falls below.
        self.ceiling = BUDGET

    def names(self, live: bool) -> list[str]:
        return [name for name, e in self.model.items() if e.live == live]

    def total(self) -> int:
        return sum(e.grant for e in self.model.values() if e.live) + sum(e.dead for e in self.model.values())

    def refused(self, call, words: str) -> None:
        before = snapshot(self.ledger)
        with pytest.raises(BudgetProtocolError, match=words):
            call()
        assert snapshot(self.ledger) == before

    def forget_if_gone(self, name: str) -> None:
        if not self.model[name].live and not self.model[name].dead:
            del self.model[name]

    def settling(self, name: str) -> int:
        """The bytes of other live engines' open tickets: creates under way."""
        return sum(e.grant - e.held for other, e in self.model.items() if e.live and other != name)

    def reserve_and_check(self, name: str, nbytes: int, ahead: int = 0) -> Decision:
        before, mine = snapshot(self.ledger), self.model[name]
        asked_of_it = {s.engine: s.reclaim_pending_bytes for s in self.ledger.status()}.get(name, 0)
        relied = sum(s.reclaim_pending_bytes for s in self.ledger.status() if s.engine != name)
        fresh = not self.waiting
        decision = self.ledger.reserve(name, nbytes, self.now, ahead)
        fits = mine.grant + nbytes <= mine.cap and self.total() + nbytes <= BUDGET
        assert (decision.verdict == Verdict.GRANTED) == fits, (
            f"a reserve of {nbytes} bytes by engine {name!r} was {decision.verdict.value}, but its grant "
            f"{mine.grant} and cap {mine.cap}, and all grants and dead bytes {self.total()} "
            f"(dead {sum(e.dead for e in self.model.values())}) of the budget {BUDGET}, "
            f"{'leave room for it' if fits else 'leave no room for it'}")
        if decision.verdict == Verdict.GRANTED:
            assert decision.ticket not in self.issued, f"ticket {decision.ticket} was issued before"
            # Bytes ahead come only from room free now, past no cap, and
            # never while a reserve waits (its own continuing wait included).
            extra = min(ahead, BUDGET - self.total() - nbytes, mine.cap - mine.grant - nbytes) if fresh else 0
            assert decision.nbytes == nbytes + extra, (
                f"a reserve of {nbytes} bytes and {ahead} ahead by engine {name!r} was granted {decision.nbytes}, "
                f"with {BUDGET - self.total()} bytes of the budget free, its cap {mine.cap} and grant {mine.grant}"
                f"{'' if fresh else ', while a reserve waits'}: expected {nbytes + extra}")
            self.issued.add(decision.ticket)
            mine.open[decision.ticket] = (decision.nbytes, self.now)
            self.waiting.discard((name, nbytes))
        elif decision.verdict == Verdict.DENIED:
            was_waiting = (name, nbytes) in self.waiting
            if not was_waiting:
                assert snapshot(self.ledger) == before  # a denial that ended no wait changes nothing
            must = self.total() + nbytes - BUDGET
            # Creates under way may give bytes back: a reserve they alone
            # could make room for waits for them, unless its engine must
            # first answer a reclaim.
            assert not (mine.grant + nbytes <= mine.cap and (was_waiting or not asked_of_it)
                        and must - relied <= self.settling(name)), (
                f"a reserve of {nbytes} bytes by engine {name!r} was denied while {must} must come back, "
                f"{relied} are asked of others and the open tickets of others hold {self.settling(name)}: "
                f"their settling could make room")
            self.waiting.discard((name, nbytes))
        else:
            was_waiting = (name, nbytes) in self.waiting
            # A waiting engine holds its cache's lock inside a commit: it
            # cannot shrink, so it is never asked, and one asked may not wait.
            assert was_waiting or not asked_of_it, (
                f"engine {name!r} began a wait for {nbytes} bytes while a reclaim of {asked_of_it} bytes asked of "
                f"it was unanswered: waiting, it could not answer")
            waiters = {engine for engine, _ in self.waiting}
            self.waiting.add((name, nbytes))
            for reclaim in decision.reclaims:
                target = self.model[reclaim.engine]
                assert reclaim.engine != name and target.live, f"a reclaim for {name!r} asks {reclaim.engine!r}"
                assert reclaim.engine not in waiters, (
                    f"a reclaim for engine {name!r} asks engine {reclaim.engine!r}, whose own reserve waits: it "
                    f"cannot shrink until that wait ends")
                assert 0 < reclaim.nbytes <= target.held - target.floor, (
                    f"a reclaim of {reclaim.nbytes} bytes from engine {reclaim.engine!r}, which holds {target.held} "
                    f"bytes with a floor of {target.floor}: it would hold {target.held - reclaim.nbytes}, below its floor")
            pending = sum(s.reclaim_pending_bytes for s in self.ledger.status() if s.engine != name)
            # A wait is for reclaims or creates under way that would make
            # room, or, once waiting, for the bytes of engines that died
            # meanwhile, seen gone soon.
            dead = sum(e.dead for e in self.model.values()) if was_waiting else 0
            settling = self.settling(name)
            assert pending + dead + settling >= self.total() + nbytes - BUDGET, (
                f"a reserve of {nbytes} bytes by engine {name!r} waits on {pending} bytes of reclaims, {settling} of "
                f"other engines' open tickets and {dead} dead, while {self.total() + nbytes - BUDGET} must come back")
        return decision

    @initialize(data=st.data())
    def engines_join(self, data):
        """Every run starts with the engines joined, holding what they draw,
        so that reserves soon meet a full budget."""
        for name in NAMES:
            self.join_as_drawn(name, data)

    @precondition(lambda self: len(self.model) < len(NAMES))
    @rule(data=st.data())
    def join(self, data):
        self.join_as_drawn(data.draw(st.sampled_from([name for name in NAMES if name not in self.model])), data)

    def join_as_drawn(self, name: str, data) -> None:
        floor, held = data.draw(st.integers(0, 250)), data.draw(HELD_BYTES)
        cap = data.draw(st.none() | st.integers(300, 1200))
        weight = data.draw(st.sampled_from([1.0, 2.0]) | st.floats(0.1, 10))
        call = lambda: self.ledger.join(name, pid=1, uid=1, floor=floor, cap=cap, weight=weight, now=self.now, held=held)
        cap = BUDGET if cap is None else min(cap, BUDGET)
        floors = sum(e.floor for e in self.model.values() if e.live)
        if floor > cap or floors + floor > BUDGET:
            return self.refused(call, "must be <=")
        call()  # held past the cap or what the budget leaves is counted all the same: those bytes exist
        self.model[name] = ModelEngine(floor, cap, held=held, ceiling=max(cap, held))
        self.ceiling = max(self.ceiling, self.total())

    @precondition(lambda self: len(self.model) < len(NAMES))
    @rule(data=st.data())
    def found(self, data):
        """A restarted daemon finds a process holding bytes before its
        engine rejoins: dead bytes, counted whatever room is left."""
        name = data.draw(st.sampled_from([name for name in NAMES if name not in self.model]))
        nbytes = data.draw(HELD_BYTES)
        self.ledger.found(name, pid=1, uid=1, nbytes=nbytes, now=self.now)
        self.model[name] = ModelEngine(0, BUDGET, live=False, dead=nbytes)
        self.forget_if_gone(name)
        self.ceiling = max(self.ceiling, self.total())

    @precondition(lambda self: self.names(live=True))
    @rule(data=st.data())
    def reserve(self, data):
        """Reserve, and as often as not create it all and confirm at once, as an engine does."""
        name, nbytes = data.draw(st.sampled_from(self.names(live=True))), data.draw(ASKED_BYTES)
        self.reserve_and_confirm(data, name, nbytes)

    @precondition(lambda self: self.names(live=True))
    @rule(data=st.data())
    def idle_engine_bursts(self, data):
        """The engine holding least for its weight asks a little past what
        is free (nothing is, while joins keep the engines past the budget):
        the reserve that makes others give back."""
        statuses = [s for s in self.ledger.status() if s.lease == "live"]
        name = min(statuses, key=lambda s: (s.grant / s.weight, s.engine)).engine
        free = max(0, BUDGET - self.total())
        self.reserve_and_confirm(data, name, free + data.draw(st.integers(1, 100)))

    @precondition(lambda self: any(s.reclaim_pending_bytes for s in self.ledger.status()))
    @rule(data=st.data())
    def asked_engine_grows(self, data):
        """An engine asked to give back reserves past what is free before it
        answers, as one whose commit was under way when the reclaim came."""
        name = data.draw(st.sampled_from([s.engine for s in self.ledger.status() if s.reclaim_pending_bytes]))
        free = max(0, BUDGET - self.total())
        # A little past what is free: the reclaims already pending for
        # others could cover it, so a ledger that let it wait would.
        self.reserve_and_confirm(data, name, free + data.draw(st.integers(1, 20)))

    def reserve_and_confirm(self, data, name: str, nbytes: int) -> None:
        """Reserve, often with bytes ahead, and as often as not create what
        was asked and keep what was granted ahead, as a budgeted driver does."""
        ahead = data.draw(st.sampled_from([0, 0, 50, 300]))
        decision = self.reserve_and_check(name, nbytes, ahead)
        if decision.verdict == Verdict.GRANTED and data.draw(st.booleans()):
            self.settle(name, decision.ticket, decision.nbytes, decision.nbytes)

    def tickets(self) -> list[tuple[str, int, int]]:
        """(engine, ticket, bytes) of every open or expired ticket."""
        return [(name, ticket, nbytes) for name, e in self.model.items() if e.live
                for ticket, nbytes in [*((t, n) for t, (n, _) in e.open.items()), *e.expired.items()]]

    @precondition(lambda self: self.tickets())
    @rule(data=st.data())
    def settle_ticket(self, data):
        name, ticket, nbytes = data.draw(st.sampled_from(self.tickets()))
        self.settle(name, ticket, nbytes, data.draw(st.none() | st.integers(0, nbytes)))

    def settle(self, name: str, ticket: int, nbytes: int, created: int | None) -> None:
        """Confirm `created` bytes of the ticket, or cancel it (None)."""
        mine = self.model[name]
        if created is None:
            self.ledger.cancel(name, ticket, self.now)
            created = 0
        else:
            self.ledger.confirm(name, ticket, created, self.now)
        if ticket in mine.open:
            del mine.open[ticket]
            mine.held += created
        else:
            del mine.expired[ticket]
            mine.held -= min(nbytes - created, mine.held)
        for name, nbytes in sorted(self.waiting):  # as the daemon does at each settling
            self.reserve_and_check(name, nbytes)

    @precondition(lambda self: self.names(live=True))
    @rule(data=st.data())
    def give_back(self, data):
        """Give back unasked (`returned`, more than held too), or answer a
        reclaim (`released` naming bytes of its own choosing, which gives
        nothing back: the bytes come as `returned`; or `cannot`), and run
        the waits again."""
        name = data.draw(st.sampled_from(self.names(live=True)))
        answer = data.draw(st.sampled_from(["returned", "released", "cannot"]))
        nbytes = data.draw(st.integers(0, 300))
        if answer == "cannot":
            self.ledger.cannot(name, self.now)
        elif answer == "released":
            self.ledger.released(name, nbytes, self.now)
        else:
            self.ledger.returned(name, nbytes, self.now)
            self.model[name].held -= min(nbytes, self.model[name].held)
        for name, nbytes in sorted(self.waiting):
            self.reserve_and_check(name, nbytes)

    @precondition(lambda self: any(s.reclaim_pending_bytes for s in self.ledger.status()))
    @rule(data=st.data())
    def answer_reclaim(self, data):
        """Answer a pending reclaim as asked, or `cannot`, and run the waits again."""
        name, asked = data.draw(st.sampled_from([(s.engine, s.reclaim_pending_bytes) for s in self.ledger.status()
                                                 if s.reclaim_pending_bytes]))
        honest = data.draw(st.booleans())
        if honest:  # it may hold less by now, having given back meanwhile
            self.ledger.returned(name, asked, self.now)
            self.ledger.released(name, asked, self.now)
            self.model[name].held -= min(asked, self.model[name].held)
        else:
            self.ledger.cannot(name, self.now)
        for name, nbytes in sorted(self.waiting):
            self.reserve_and_check(name, nbytes)

    @precondition(lambda self: len(self.names(live=True)) > 1)  # a run with no engine left tests little
    @rule(data=st.data())
    def leave(self, data):
        name = data.draw(st.sampled_from(self.names(live=True)))
        self.ledger.leave(name, self.now)
        mine = self.model[name]
        mine.live, mine.dead, mine.held = False, mine.grant, 0
        mine.open.clear()
        mine.expired.clear()
        self.waiting = {(engine, nbytes) for engine, nbytes in self.waiting if engine != name}
        self.forget_if_gone(name)

    @precondition(lambda self: self.names(live=False))
    @rule(data=st.data())
    def seen_gone(self, data):
        name, outside = data.draw(st.sampled_from(self.names(live=False))), data.draw(st.integers(-10, 300))
        self.ledger.seen_gone(name, outside, self.now)
        self.model[name].dead = min(self.model[name].dead, max(outside, 0))
        self.forget_if_gone(name)

    @rule(data=st.data())
    def time_passes(self, data):
        self.now += data.draw(st.sampled_from([0.5, RECLAIM_DEADLINE_S, TICKET_TTL_S]))
        events = self.ledger.expire(self.now)
        expected = []
        for name, mine in self.model.items():
            for ticket, (nbytes, issued_at) in list(mine.open.items()):
                if issued_at + TICKET_TTL_S <= self.now:
                    del mine.open[ticket]
                    mine.expired[ticket] = nbytes
                    mine.held += nbytes
                    expected.append(TicketExpired(name, ticket, nbytes))
        assert [e for e in events if isinstance(e, TicketExpired)] == expected
        for denied in (e for e in events if isinstance(e, ReserveDenied)):
            self.waiting.remove((denied.engine, denied.nbytes))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def illegal(self, data):
        ledger, now = self.ledger, self.now
        calls = [(lambda: ledger.reserve("nobody", 1, now), "reserve: engine 'nobody' is absent, expected live"),
                 (lambda: ledger.confirm("nobody", 1, 0, now), "confirm: engine 'nobody' is absent, expected live"),
                 (lambda: ledger.expire(math.nan), "now must be a finite real number")]
        # Each call binds its values as defaults: a closure would see the loop's last ones.
        for name in self.names(live=False):
            calls += [(lambda name=name: ledger.reserve(name, 1, now), "reserve: engine .* is dead, expected live"),
                      (lambda name=name: ledger.leave(name, now), "leave: engine .* is dead, expected live")]
        for name in self.names(live=True):
            mine = self.model[name]
            calls += [(lambda name=name: ledger.returned(name, -1, now), "nbytes must be an int >= 0"),
                      (lambda name=name: ledger.reserve(name, 0, now), "nbytes must be an int >= 1"),
                      (lambda name=name: ledger.confirm(name, 10**9, 0, now), "never issued"),
                      (lambda name=name: ledger.seen_gone(name, 0, now), "is live, expected dead"),
                      (lambda name=name: ledger.found(name, pid=1, uid=1, nbytes=1, now=now),
                       "found: engine .* is live, expected absent"),
                      (lambda name=name: ledger.join(name, pid=1, uid=1, floor=0, cap=None, weight=1.0, now=now),
                       "join: engine .* is live, expected absent")]
            calls += [(lambda name=name, ticket=ticket, nbytes=nbytes: ledger.confirm(name, ticket, nbytes + 1, now),
                       "created must be <=") for ticket, (nbytes, _) in mine.open.items()]
            closed = self.issued - set(mine.open) - set(mine.expired)
            calls += [(lambda name=name, ticket=ticket: ledger.cancel(name, ticket, now), "ticket must be one of")
                      for ticket in closed]
        self.refused(*data.draw(st.sampled_from(calls)))

    @invariant()
    def the_budget_holds(self):
        """Grants and dead bytes within the budget, and each grant within its
        cap, but where joins brought more: then nothing grows until they fall
        back within it."""
        granted, dead = self.ledger.granted, self.ledger.dead
        assert granted + dead <= self.ceiling, (
            f"granted {granted} and dead {dead} bytes: past the budget {BUDGET}"
            + (f" and the {self.ceiling} bytes joins brought" if self.ceiling > BUDGET else ""))
        self.ceiling = max(BUDGET, granted + dead)
        assert self.ledger.over_budget == self.ceiling - BUDGET, (
            f"the ledger reads {self.ledger.over_budget} bytes over the budget {BUDGET}, "
            f"with granted {granted} and dead {dead} bytes")
        statuses = self.ledger.status()
        for s in statuses:
            mine = self.model[s.engine]
            if s.lease == "live":
                assert s.grant <= mine.ceiling and s.over_cap == max(0, s.grant - s.cap), (
                    f"engine {s.engine!r}: grant {s.grant} of at most {mine.ceiling} (its cap {s.cap}, or what it "
                    f"joined holding until it falls below), read as {s.over_cap} bytes over its cap")
                mine.ceiling = max(s.cap, s.grant)
            assert s.held >= 0 and s.dead >= 0, f"engine {s.engine!r}: held {s.held}, dead {s.dead}"
        # Per engine: (live, held, dead, open ticket bytes, expired tickets).
        seen = {s.engine: (s.lease == "live", s.held, s.dead, s.open_ticket_bytes, s.expired_tickets) for s in statuses}
        model = {name: (e.live, e.held, e.dead, e.grant - e.held, len(e.expired)) for name, e in self.model.items()}
        assert seen == model, (f"the ledger's (live, held, dead, open ticket bytes, expired tickets) {seen}, "
                               f"the model's {model}")
        assert granted + dead == self.total(), f"granted {granted} and dead {dead} bytes, the model's {self.total()}"


def ledger_machine(make_ledger: Callable[[int], Ledger] = Ledger) -> type[LedgerMachine]:
    """The machine over the ledgers `make_ledger(budget)` builds."""
    return type(f"LedgerMachine_{getattr(make_ledger, '__name__', 'made')}", (LedgerMachine,),
                {"make_ledger": staticmethod(make_ledger)})
