"""`extkv stress` and the stress section of a report.

Theory of operation
-------------------
The stress run puts extkv under load for a bounded time: `run` (the
command) runs the stress suite (`stress/`, whose workloads are
extkv.testing.stress) in one pytest process; `report` reads what it left
and renders the stress section of `summary.md`, with its verdict and memory
plots. Neither imports the workloads, which need the test extra
(hypothesis): a report renders without it. It stands on extkv.runs;
extkv.report puts its section beside the other kinds'.
"""
