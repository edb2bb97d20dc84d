"""The steps of a driver that a fault can be injected into.

A plain name list, apart from extkv.vmm (whose package imports torch), so
that what only reads a run's results (extkv.stress.report's table of
injected faults) can name the steps without importing torch;
extkv.vmm.faults counts and fails them, and extkv.vmm re-exports them.
"""

#: Steps a fault can be planned for, in the order a resize performs them, then
#: the two that share chunks between processes (a KV connector's export and
#: its peer's import).
FAULTABLE_STEPS = ("reserve", "create", "map", "set_access", "unmap", "release", "export", "import")
