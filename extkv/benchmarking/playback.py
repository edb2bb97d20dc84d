"""pytest-benchmark records what the engine measured: rounds played back through a clock.

Theory of operation
-------------------
Each (case, contender) is one pytest test (bench/bench_kv.py) whose
`benchmark.pedantic` plays the measured rounds back through
`playback_clock`, which `extkv bench` passes as `--benchmark-timer`
(`PLAYBACK_TIMER`); so `bench.json` holds one benchmark per (case,
contender) whose `stats.data` are the interleaved wall times, with the
case, the CPU times and any pivot in `extra_info`. `record` checks that the
timer really was the playback clock: pytest-benchmark timing the playback
itself would record nothing the engine measured.

The same benchmarks, rounds included, are what `extkv bench` saves in
pytest-benchmark's storage (extkv.benchmarking.run), so that its `compare`
and `--benchmark-compare-fail` set run against run the very rounds the
report reads. pytest-benchmark cannot measure them itself: it runs one
benchmark's rounds back to back, and a case's contenders must interleave
round by round in one process (extkv.benchmarking.rounds).
"""

from __future__ import annotations

from .cases import Case
from .contenders import CONTENDERS
from .measure import Measurement


class PlaybackClock:
    """pytest-benchmark's timer under `extkv bench`: it reads back the
    durations the engine measured instead of timing anything itself."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def start_at_zero(self, duration: float) -> tuple[tuple[float], dict]:
        """pedantic's setup: the next round starts at 0 and lasts `duration`."""
        self.now = 0.0
        return (duration,), {}

    def advance(self, duration: float) -> None:
        self.now += duration


_playback = PlaybackClock()


def playback_clock() -> float:
    """The `--benchmark-timer` of `extkv bench` (pytest-benchmark names a
    timer by module and function name)."""
    return _playback()


#: Its dotted name, as pytest-benchmark takes it.
PLAYBACK_TIMER = f"{__name__}.playback_clock"


def record(benchmark, case: Case, measurement: Measurement) -> None:
    """Hand one measured (case, contender) to pytest-benchmark's fixture:
    metadata into `extra_info`, the wall times as its rounds."""
    contender = CONTENDERS[measurement.contender]
    benchmark.group = case.id
    benchmark.extra_info.update(
        {
            **case.facts(),
            "contender": contender.name,
            "role": contender.role,
            "contender_what": contender.describe(),
            "process": measurement.process,
            "cpu": measurement.cpu,
            "own_cpu": measurement.own_cpu,
            "own_cpu_evicted": measurement.own_cpu_evicted,
            "python_instructions": measurement.python_instructions,
            "pivot": measurement.pivot,
        }
    )
    durations = iter(measurement.wall)
    benchmark.pedantic(
        _playback.advance,
        setup=lambda: _playback.start_at_zero(next(durations)),
        rounds=len(measurement.wall),
    )
    recorded = benchmark.stats.stats.data
    if recorded != measurement.wall:
        raise RuntimeError(
            f"pytest-benchmark recorded {recorded} for {case.id}/{contender.name}, not the measured {measurement.wall}: "
            f"its timer must be extkv's playback clock (--benchmark-timer={PLAYBACK_TIMER}); run `extkv bench`"
        )
