"""Child processes for tests, started from one fork server that imported torch.

Theory of operation
-------------------
A test that needs a process of its own (a pytest session, `python -c`, a
rank of a process group, a child that may crash) spends about 2 s of CPU
on a fresh interpreter importing torch (2-core CI host). multiprocessing's
fork server imports torch once (CUDA untouched, so each child creates its
own context) and forks every child from there. It preloads torch alone:
pytest rewrites the asserts of extkv's modules only as a session imports
them, and a test that blocks an import must meet a module not yet imported.
The server is one per test process, shared by every test that asks.

`python_c` runs `python -c CODE` so, in an environment of the caller's
choosing, with its output in files that are read back even when the child
dies before its code ran.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path

#: What a child runs (through `exec`, so that unpickling its target imports
#: nothing): CODE in directory CWD with ENVIRONMENT, its output into the
#: files STDOUT and STDERR.
_PYTHON_C = """
import os
os.chdir(CWD)
os.environ.clear()
os.environ.update(ENVIRONMENT)
for fd, path in ((1, STDOUT), (2, STDERR)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
exec(CODE, {"__name__": "__main__"})
"""


def fork_server():
    """multiprocessing's fork-server context, preloading torch only."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context


def start_reporting(target, *args):
    """A daemonic child of the fork server running `target(*args, sender)`,
    and the parent's end of the pipe `sender` writes reports into (the
    parent's copy of the writing end is closed, so a child that dies shows
    as the end of the pipe)."""
    context = fork_server()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, sender), daemon=True)
    process.start()
    sender.close()
    return process, receiver


def one_report(timeout_s: float, target, *args):
    """`start_reporting(target, *args)` for a child that sends one report:
    its exit code and the report (None where it died before sending it,
    or sent nothing within `timeout_s`)."""
    process, receiver = start_reporting(target, *args)
    try:
        report = receiver.recv() if receiver.poll(timeout_s) else None
    except EOFError:  # it died before sending
        report = None
    finally:
        exit_code = reap(process, receiver, timeout_s)
    return exit_code, report


def reap(process, receiver, timeout_s: float) -> int | None:
    """End a fork-server child once its reports are read (or it died
    first): join it within `timeout_s`, kill it if it still lives, close
    the parent's end of its pipe; its exit code (negative: the signal)."""
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join()
    receiver.close()
    return process.exitcode


def python_c(code: str, outputs: Path, environment: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c CODE` in a child of the fork server, in this process's
    directory. Output goes through `outputs`.stdout and .stderr (removed once
    read); `environment` defaults to this process's; a child past `timeout`
    is killed."""
    stdout, stderr = outputs.with_name(outputs.name + ".stdout"), outputs.with_name(outputs.name + ".stderr")
    for path in (stdout, stderr):
        path.write_text("")  # read back even where the child died before its code ran
    names = {"CODE": code, "CWD": os.getcwd(), "ENVIRONMENT": dict(os.environ) if environment is None else environment,
             "STDOUT": str(stdout), "STDERR": str(stderr)}
    child = fork_server().Process(target=exec, args=(_PYTHON_C, names), daemon=True)
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
    finished = subprocess.CompletedProcess(["-c", code], child.exitcode, stdout.read_text(), stderr.read_text())
    stdout.unlink()
    stderr.unlink()
    return finished
