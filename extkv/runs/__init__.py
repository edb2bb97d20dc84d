"""What every kind of run shares, below all of them.

Theory of operation
-------------------
`extkv check`, `extkv bench` and `extkv stress` each run pytest in steps and
leave their raw results in one run directory; each kind is a wing of its own
(extkv.check, extkv.benchmarking, extkv.stress) holding its command and its
section of the report. What the wings share lives here, below every
one of them, so that no wing imports another: where a run's files go and
how they are read and written (`rundir`), the machine's facts (`machine`),
the pytest step processes and how a signal ends them (`steps`), pytest's
exit statuses, the harness's results files and the options that narrowed a
run (`results`), recorded
commands shown without the machine's paths (`portable`), whether plots can
be drawn (`plots`) and what every run command takes (`commands`).
extkv.report, above the wings, puts their sections together.
"""
