"""The budget daemon's journal of engine processes: who may hold memory when a daemon restarts.

Theory of operation
-------------------
A daemon that restarts starts with an empty ledger; its engines rebuild it
as they rejoin (extkv.budget.client). An engine slow to rejoin (stopped,
swapped out, its rejoin thread waiting out a back-off) still holds its
memory meanwhile, and a ledger that did not count it would grant those
bytes to the others. So the daemon keeps, beside its socket, the list of
processes whose leases it counts (`<device key>.engines`: each process's
pid and its start time, which tells a process from a later one given the
same pid), rewritten whenever that list changes. A daemon starting on the
same path reads it back (`processes_to_count`): every process of it that
still lives, with the same start time, is counted at its outside reading, as a dead lease is, until
the process rejoins with what it holds or its memory is seen gone
(extkv.budget.daemon).

The journal lives in the daemon's run directory, which is this uid's alone
(extkv.budget.listener), and is written by rename, so a reader sees a whole
list or the one before. Anything there that is not a regular file holding
such a list is reported and ignored: the journal can only add counted
bytes, never take any away.
"""

from __future__ import annotations

import json
import os
import stat


def journal_path(socket_path: str) -> str:
    """The journal beside the socket `<run dir>/<key>.sock`: `<run dir>/<key>.engines`."""
    return os.path.splitext(socket_path)[0] + ".engines"


def start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (field 22
    of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            line = stat_file.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold anything: count from the last ')'.
    return int(line[line.rindex(b")") + 2:].split()[19])


def write(path: str, processes: dict[int, int]) -> None:
    """Replace the journal at `path` with `processes` (pid -> start time)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as journal:
        json.dump({"processes": sorted([pid, started] for pid, started in processes.items())}, journal)
    os.replace(temporary, path)


def processes_to_count(path: str) -> tuple[dict[int, int], str | None]:
    """The journal's processes (pid -> start time), and why the journal was
    ignored, if it was (None when it was read, or there was none). Whether
    each still lives as the same process is the reader's to check, once it
    holds the process (a pidfd), so that no later process passes for it."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return {}, None
    if not stat.S_ISREG(found.st_mode):
        return {}, f"{path} is not a regular file: ignored"
    try:
        with open(path) as journal:
            listed = json.load(journal)["processes"]
        processes = {int(pid): int(started) for pid, started in listed}
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {}, f"{path} cannot be read as a journal ({type(error).__name__}: {error}): ignored"
    return processes, None
