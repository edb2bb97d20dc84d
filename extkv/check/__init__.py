"""`extkv check` and the check section of a report.

Theory of operation
-------------------
The check certifies a machine: `run` (the command) runs the conformance
suite in steps on every device; `report` merges the steps' results and
renders the check section of `summary.md`, with `verdict` (what the run
certified) and `plots` (each device's memory timeline). It stands on
extkv.runs and extkv.testing; extkv.report puts its section beside the
other kinds'.
"""
