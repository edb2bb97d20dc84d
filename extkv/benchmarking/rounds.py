"""Rounds and their order: the Williams design that interleaves a case's contenders.

Theory of operation
-------------------
The driver has state: a 32 GiB create right after 32 GiB were released ran
10x slower on an H200 than on never-used memory. So the contenders of a
case are measured together, interleaved: round r runs every contender once,
in row r of a Williams design (`round_order`). A round meets the state its
predecessor left, and plain rotation keeps predecessors fixed (in a, b, c
rotated, b always follows a); a Williams design gives each contender every
other one as predecessor equally often (once each over n rounds for an even
number n of contenders, twice each over 2n for an odd one). That state
outlasts a round (on the H200 the raw sequence's 64 GiB growth read 17.5 ms
at best when the release two rounds before was its own, 19.9 ms when it was
extkv's), and rows run back to back give a contender its own round two
before more often than another's: so every other pass over the design
trades the places of extkv and its yardstick, the raw sequence, and the two
meet the same predecessors at both lags.

Rounds stop at a count, or at the end of the round in which a case has used
its seconds (`in_rounds`); a costly peer's rounds (capped at a count of
their own) use none of them. The same order interleaves anything: the
contenders of a case, or (case, contender) pairs across cases.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence, TypeVar


#: What `round_order` and `in_rounds` rotate: contender names, (case, name) pairs.
T = TypeVar("T")


def round_order(names: Sequence[T], round_index: int) -> list[T]:
    """Row `round_index` of a Williams design over `names`: the first row is
    0, 1, n-1, 2, n-2, ...; row r adds r to each position (mod n); for an
    odd n, rows n..2n-1 are those rows reversed. In every other pass over
    the design (n rows, 2n for an odd n) the first two names trade places:
    rows run back to back give a contender its own round two before more
    often than another's, so the subject (`names[0]`) and its yardstick
    (`names[1]`) would meet unequal states; over two passes they meet each
    other's predecessors equally often, one and two rounds back alike, but
    for the rounds where the passes meet."""
    n = len(names)
    if n > 1 and (round_index // (n if n % 2 == 0 else 2 * n)) % 2:
        names = [names[1], names[0], *names[2:]]
    first_row, low, high = [0], 1, n - 1
    while len(first_row) < n:
        first_row.append(low)
        low += 1
        if len(first_row) < n:
            first_row.append(high)
            high -= 1
    row = [(position + round_index) % n for position in first_row]
    if n % 2 and (round_index // n) % 2:
        row.reverse()
    return [names[position] for position in row]


def in_rounds(
    items: Sequence[T],
    live: Callable[[T], bool],
    *,
    rounds: int,
    case_seconds: float,
    charged: Callable[[T], bool] = lambda item: True,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[T]:
    """`items` round by round, round r giving each item still `live` once,
    in row r of `round_order`; stops after `rounds`, once no item is live,
    or at the end of the first round after which the items `charged` for
    their time have used more than `case_seconds`. A costly peer is not
    charged: it has a round cap of its own, and two of its rounds (about
    6 s in a 64-step growth on the H200) would otherwise leave the others
    of its case two to five rounds where they would get nine."""
    used = 0.0
    for round_index in range(rounds):
        current = [item for item in items if live(item)]
        if not current:
            return
        for item in round_order(current, round_index):
            began = clock()
            yield item
            if charged(item):
                used += clock() - began
        if used > case_seconds:
            return
