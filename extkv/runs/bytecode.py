"""Bytecode for the processes of one run where the environment forbids writing it.

Theory of operation
-------------------
`extkv check` starts dozens of Python processes: a pytest step per device,
its xdist workers, each worker's fork server, the children tests start; each
imports torch. Container images commonly set PYTHONDONTWRITEBYTECODE and
install packages without their bytecode, and there every process compiles
what it imports from source. On a 16-core H100 machine set up that way
(Python 3.12, torch 2.11, no __pycache__ under torch/), `import torch` took
5.2-5.6 s in every process, warm or cold, and building a two-layer Llama of
transformers 16.5 s; on the 2-core host, the same imports from source took
3.1-3.4 s and 8.8 s, against 1.3 s and 3.7 s from bytecode.

Where writing bytecode is forbidden, no prefix is set (PYTHONPYCACHEPREFIX,
`-X pycache_prefix`) and torch has no bytecode where Python looks for it
(pip writes it at install unless told not to, and then nothing is to be
gained), `run_bytecode()` gives the run a temporary directory of its own as
the bytecode tree: this process writes there from then on
(sys.pycache_prefix), and the processes it starts inherit it
(PYTHONPYCACHEPREFIX, with PYTHONDONTWRITEBYTECODE unset for them). So the
first process to import a module compiles it once for every later one, and
the run's own process, which imports torch before it starts any step, does
so for torch. Nothing is written beside the sources, the directory goes
when the run ends, and the process's own settings come back. Anywhere else
it changes nothing.

On COMPILE_AHEAD_CORES cores or more, torch's package is compiled into the
tree first, every file of it, one compiler process per core (compileall):
an import compiles its modules one after another, and the run waits for it
before its first step. On the 2-core host, compiling all of torch 2.13's
2,285 files took 7.8 s of CPU (5.1 s of wall time on both cores), against
3.8 s for `import torch` from source, and from bytecode the import then
takes 1.3 s: on c cores about 7.8 / c + 1.3 s against 3.8 s, less from
four cores on.
"""

from __future__ import annotations

import compileall
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterator

#: The environment variables that forbid writing bytecode and that place it.
FORBIDS = "PYTHONDONTWRITEBYTECODE"
PREFIX = "PYTHONPYCACHEPREFIX"
#: The module whose bytecode decides: what every process of a run imports, and the most of it.
DECIDING_MODULE = "torch"
#: Cores from which DECIDING_MODULE's package is compiled ahead, a process per core.
COMPILE_AHEAD_CORES = 4


def compile_ahead(module: str, cores: int) -> bool:
    """Compile every file of `module`'s package into this process's tree,
    `cores` compilers at once; whether it did (not below
    COMPILE_AHEAD_CORES, nor for a module that is no package). A file that
    does not compile is left to its import, which reports it."""
    spec = importlib.util.find_spec(module)
    locations = None if spec is None else spec.submodule_search_locations
    if cores < COMPILE_AHEAD_CORES or not locations:
        return False
    for location in locations:
        compileall.compile_dir(location, quiet=2, workers=cores)
    return True


def _compiled(module: str) -> bool:
    """Whether `module` (found, not imported) has its bytecode where this
    process would read it, or is no source to compile."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.has_location or not spec.origin or not spec.origin.endswith(".py"):
        return True
    return os.path.exists(importlib.util.cache_from_source(spec.origin))


@contextlib.contextmanager
def run_bytecode(say: Callable[[str], None]) -> Iterator[str | None]:
    """Inside, this process and those it starts keep bytecode in a temporary
    directory (yielded), where writing it is forbidden, no prefix is set and
    DECIDING_MODULE has none; elsewhere nothing changes (None). `say` is
    told the directory and why."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None or _compiled(DECIDING_MODULE):
        yield None
        return
    directory = tempfile.mkdtemp(prefix="extkv-bytecode-")
    environment = {name: os.environ.get(name) for name in (FORBIDS, PREFIX)}
    sys.pycache_prefix, sys.dont_write_bytecode = directory, False
    os.environ[PREFIX] = directory
    os.environ.pop(FORBIDS, None)
    try:
        say(f"bytecode of this run's processes goes to {directory}, removed at the end (writing it is forbidden "
            f"here and {DECIDING_MODULE} has none, so each process would compile it from source)")
        cores = len(os.sched_getaffinity(0))
        started = time.monotonic()
        if compile_ahead(DECIDING_MODULE, cores):
            say(f"{DECIDING_MODULE} compiled into it on {cores} cores in {time.monotonic() - started:.1f} s")
        yield directory
    finally:
        sys.pycache_prefix, sys.dont_write_bytecode = None, True
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(directory, ignore_errors=True)
