"""Where an operation's arguments come from: Hypothesis's draws, or a seeded
random generator.

Theory of operation
-------------------
An operation of `ModelledCache` (extkv.testing.modelled_cache) asks a
`Choices` for each argument, an integer in a range or a boolean, and hands it
a note naming the call, so a failing run reads as a script. `DrawnChoices`
draws from Hypothesis, so a failure shrinks and the notes go into its report.
`SeededChoices` takes them from a `random.Random(seed)`, for endurance runs of
many thousand steps that Hypothesis's per-step cost would slow down: the same
seed replays the same run, and the last notes, numbered by step, name the
steps that led to a failure.
"""

from __future__ import annotations

import abc
import collections
import random

from hypothesis import note
from hypothesis import strategies as st


class Choices(abc.ABC):
    """The arguments of each operation, and a place for notes that make a
    failing run read as a script."""

    @abc.abstractmethod
    def integer(self, low: int, high: int, label: str) -> int: ...

    @abc.abstractmethod
    def boolean(self, label: str) -> bool: ...

    @abc.abstractmethod
    def note(self, text: str) -> None: ...


class DrawnChoices(Choices):
    """Arguments drawn by Hypothesis (so they shrink); notes go into its report."""

    def __init__(self, data):
        self.data = data

    def integer(self, low: int, high: int, label: str) -> int:
        return self.data.draw(st.integers(low, high), label=label)

    def boolean(self, label: str) -> bool:
        return self.data.draw(st.booleans(), label=label)

    def note(self, text: str) -> None:
        note(text)


class SeededChoices(Choices):
    """Arguments from a `random.Random(seed)`: the same seed replays the same
    run. The last `remembered` notes are kept, numbered by `step`, so a
    failure names the steps that led to it."""

    def __init__(self, seed: int, remembered: int = 64):
        self.seed = seed
        self.random = random.Random(seed)
        self.recent: collections.deque[str] = collections.deque(maxlen=remembered)
        self.step = 0

    def integer(self, low: int, high: int, label: str) -> int:
        return self.random.randint(low, high)

    def boolean(self, label: str) -> bool:
        return self.random.random() < 0.5

    def note(self, text: str) -> None:
        self.recent.append(f"step {self.step}: {text}")
