"""The benchmarks behind `extkv bench`: extkv's KV cache against raw driver sequences and peers.

Theory of operation
-------------------
Every figure of a case is a ratio: extkv's time over the time of a
contender doing the same work, measured in the same run, interleaved round
by round. The shared budget's bench also reads times against bounds of its
own (a grant's p99, a reclaim's time past the release). The package,
lowest module first:

- contenders: `primitives` (each device's raw calls), `store` (what every
  contender is), `raw` (the raw driver sequence, written once), `clocks`
  (CPU time inside the driver's steps), `contenders` (every contender and
  the cases it runs in);
- the catalogue: `geometry` (the KV shapes) and `cases` (operations,
  profiles, the cases of a run in the order they are measured);
- measuring: `rounds` (the order of a round), `measure` (rounds timed),
  `engine` (a run's cases, processes and `bench_cases.json`), `playback`
  (pytest-benchmark records what the engine measured);
- engine-level benches: `decode`, `growth_loop` and `budget_bench` (the
  shared KV budget's costs), each one JSON object a run;
- the report: `results` (a run's files read back), `targets` (verdicts),
  `plots`, `report` (the bench section of `summary.md`), with
  `budget_report` and the decode and growth loop's beside it;
- the commands: `run` (`extkv bench`) and `pool` (`extkv pool`).
"""
