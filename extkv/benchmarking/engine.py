"""The engine: a run's cases measured once each, peers in processes of their own, `bench_cases.json`.

Theory of operation
-------------------
`Engine` measures the cases of a profile's catalogue, each the first time
one of its contenders is asked for (bench/bench_kv.py asks in catalogue
order), with the rounds and seconds the profile gives it (more for the
headline readings), and keeps the results. A run has a budget of seconds: a
case that would start after it is reported as not run, with that reason,
so a run never overstays its machine. It warms every contender up on a
tiny case first, so that first-call costs (kernel loading, lazy imports)
land in no case, and probes once what the driver maps and grants over part
of a chunk (extkv.benchmarking.primitives).

Fresh cases run in a new process each (`python -m extkv.benchmarking.engine
REQUEST RESULT`, served by `_serve`), so that their memory is never-used.
Peers that need a process of their own (torch's expandable segments, which
is chosen when a process starts; torch_memory_saver, whose allocator hook
changes torch) run in one subprocess per kind for all cases that need
them, interleaved there with the case's *pivot* (memset for commits, the
raw sequence for releases). Every figure is a ratio measured inside one
process: a peer in another process is compared through the pivots,
(extkv / pivot here) / (peer / pivot there). A process that dies or
overstays leaves its contenders not run, with its last words.

`finish` writes `bench_cases.json`: the run's facts and every case,
measured or not, with the reasons, and the order its rounds ran in (a
release leaves driver state behind that outlasts the next allocations, so
a round is read beside its predecessors).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .. import vmm
from .cases import HEADLINE_READINGS, OPERATIONS, PROFILES, Case, Profile, catalogue
from .clocks import largest_cpu_cache_bytes
from .contenders import CONTENDERS, PROCESS_ENVIRONMENT
from .geometry import GEOMETRIES
from .measure import (
    FLATNESS_CONTENDERS,
    Measurement,
    interleave,
    interleave_evicted,
    measure_fresh,
    not_runnable,
    recorded_failure,
    warm_up,
)
from .primitives import clock_note, primitives_for
from .result_files import CASES_FILE
from .sizes import MiB

class Engine:
    """Measures the cases of one run, each once, on first request."""

    def __init__(
        self,
        profile: Profile,
        device: torch.device | str,
        run_dir: Path,
        *,
        rounds: int | None = None,
        budget_seconds: float | None = None,
        log: Callable[[str], None] | None = None,
        warm: bool = True,
    ):
        self.profile = profile
        self.device = vmm.canonical_device(device)
        self.run_dir = Path(run_dir)
        self.rounds = profile.rounds if rounds is None else rounds
        if self.rounds < 1:
            raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
        #: Rounds asked for by name apply to every case alike.
        self.rounds_given = rounds is not None
        self.budget_seconds = profile.budget_seconds if budget_seconds is None else budget_seconds
        self.log = log or (lambda line: print(line, flush=True))
        self.cases = catalogue(profile)
        self._by_id = {case.id: case for case in self.cases}
        self._results: dict[str, dict[str, Measurement]] = {}
        #: Case id -> the contenders of this process in the order their
        #: rounds ran: a release leaves driver state behind that outlasts
        #: the next allocations, so the report reads rounds by predecessor.
        self._orders: dict[str, list[str]] = {}
        self._batches: dict[str, dict[str, dict[str, Measurement]]] = {}
        #: `interleave_evicted` over both ends of the byte series, once run.
        self._evicted: dict[tuple[str, str], list[float] | BaseException] | None = None
        self.clocks = [clock_note(self.device)]
        primitives = primitives_for(self.device)
        supported, how = primitives.probe_partial_map()
        #: Whether the driver maps part of a chunk: where not, the raw
        #: sequence's one chunk per segment per commit is the fewest calls.
        self.partial_map = {"supported": supported, "how": how}
        supported, how = primitives.probe_partial_access()
        #: Whether it grants access over part of a chunk: where not, a
        #: chunk's zeroing waits for the whole chunk's creation and grant.
        self.partial_access = {"supported": supported, "how": how}
        self.started = time.perf_counter()
        if warm:
            self._warm_up()
        self.log(
            f"extkv bench: {len(self.cases)} cases, profile {profile.name} ({profile.what}) on {self.device}; "
            f"rounds <= {self.rounds}, budget {self.budget_seconds:.0f} s"
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def case(self, case_id: str) -> Case:
        return self._by_id[case_id]

    def _warm_up(self) -> None:
        warm_up(self.device, [name for name, contender in CONTENDERS.items() if contender.process == "main"], OPERATIONS)

    def measure(self, case: Case) -> dict[str, Measurement]:
        if case.id in self._results:
            return self._results[case.id]
        position = self.cases.index(case) + 1
        case_started = time.perf_counter()
        if self.elapsed() > self.budget_seconds:
            results = {name: Measurement(name, CONTENDERS[name].process) for name in case.contenders}
            for measurement in results.values():
                measurement.stop("not run", f"time budget of {self.budget_seconds:.0f} s spent before this case")
        elif case.state == "fresh":
            # A process per contender: each measures on memory no process of
            # its own used, and the device need hold one store only (three
            # 32 GiB stores at once did not fit an 80 GB H100).
            results = {}
            for name in case.contenders:
                results.update(self._in_subprocess("fresh", [(case, [name])])[case.id])
        else:
            here = [name for name in case.contenders if CONTENDERS[name].process == "main"]
            rounds, case_seconds = self.rounds_for(case)
            self._orders[case.id] = []
            results = interleave(
                case,
                here,
                self.device,
                rounds=rounds,
                case_seconds=case_seconds,
                costly_rounds=self.profile.costly_rounds,
                order_log=self._orders[case.id],
            )
            for name in case.contenders:
                if name not in results:
                    results[name] = self._peer(case, name)
            if self.profile.is_bytes_flatness_end(case):
                self._add_evicted_readings(case, results)
        self._results[case.id] = results
        self.log(
            f"bench [{position}/{len(self.cases)}] {case.id}: "
            + ", ".join(results[name].summary() for name in case.contenders)
            + f" (min of <= {self.rounds_for(case)[0]} rounds; {time.perf_counter() - case_started:.1f} s, "
            f"{self.elapsed():.0f} s of {self.budget_seconds:.0f} s)"
        )
        return results

    def _add_evicted_readings(self, case: Case, results: dict[str, Measurement]) -> None:
        """Give `case`, an end of the byte series, its own CPU readings with
        the caches evicted, from one `interleave_evicted` over both ends
        run at the first of them the run reaches."""
        if self._evicted is None:
            ends = [end for end in self.cases if self.profile.is_bytes_flatness_end(end)]
            rounds, case_seconds = self.rounds_for(case)
            self._evicted = interleave_evicted(ends, FLATNESS_CONTENDERS, self.device, rounds=rounds,
                                               case_seconds=case_seconds)
        for name in FLATNESS_CONTENDERS:
            measurement = results.get(name)
            if measurement is None or measurement.status != "measured":
                continue
            readings = self._evicted[(case.id, name)]
            if isinstance(readings, BaseException):
                measurement.stop(*recorded_failure(CONTENDERS[name], readings))
            else:
                measurement.own_cpu_evicted = list(readings)

    def rounds_for(self, case: Case) -> tuple[int, float]:
        """Rounds and seconds `case` may take in this process."""
        profile = self.profile
        if self.rounds_given:
            return self.rounds, profile.case_seconds
        rounds, case_seconds = self.rounds, profile.case_seconds
        if profile.headline_rounds and profile.is_headline_reading(case):
            if case.op == "grow8" and profile.growth_headline_rounds:
                rounds, case_seconds = profile.growth_headline_rounds, profile.growth_headline_case_seconds
            else:
                rounds, case_seconds = profile.headline_rounds, profile.headline_case_seconds
        if case.bytes <= profile.small_case_bytes:
            rounds = max(rounds, profile.small_case_rounds)
        return rounds, case_seconds

    def _peer(self, case: Case, name: str) -> Measurement:
        contender = CONTENDERS[name]
        reason = not_runnable(contender, self.device)
        if reason:
            measurement = Measurement(name, contender.process)
            measurement.stop("not run", reason)
            return measurement
        if contender.process not in self._batches:
            jobs = [
                (other, [n for n in other.contenders if CONTENDERS[n].process == contender.process]
                 + [OPERATIONS[other.op].pivot])
                for other in self.cases[self.cases.index(case):]
                if other.state != "fresh" and any(CONTENDERS[n].process == contender.process for n in other.contenders)
            ]
            self._batches[contender.process] = self._in_subprocess(contender.process, jobs)
        batch = self._batches[contender.process].get(case.id, {})
        measurement = batch.get(name)
        if measurement is None:
            measurement = Measurement(name, contender.process)
            measurement.stop("not run", f"the {contender.process} process did not reach this case")
            return measurement
        pivot = batch.get(OPERATIONS[case.op].pivot)
        if pivot is not None and pivot.status == "measured":
            measurement.pivot = {"contender": pivot.contender, "wall": pivot.wall, "cpu": pivot.cpu}
        return measurement

    def _in_subprocess(self, process: str, jobs: list[tuple[Case, list[str]]]) -> dict[str, dict[str, Measurement]]:
        """Run `jobs` in a new process (its environment from
        `PROCESS_ENVIRONMENT`); every contender of a job that fails to come
        back is recorded as not run, with the process's last words."""
        remaining = max(self.budget_seconds - self.elapsed(), 1.0)
        request = {
            "profile": self.profile.name,
            "device": str(self.device),
            "rounds": self.rounds,
            "process": process,
            "seconds": remaining,
            "jobs": [{"case": case.id, "contenders": names} for case, names in jobs],
        }
        environment = {**os.environ, **PROCESS_ENVIRONMENT.get(process, {})}
        package_root = str(Path(__file__).resolve().parents[2])
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
        with tempfile.TemporaryDirectory(prefix="extkv-bench-") as scratch:
            request_path, result_path = Path(scratch, "request.json"), Path(scratch, "result.json")
            request_path.write_text(json.dumps(request))
            self.log(f"bench: {process} process for {len(jobs)} case(s) ...")
            try:
                finished = subprocess.run(
                    [sys.executable, "-m", __name__, str(request_path), str(result_path)],
                    env=environment,
                    capture_output=True,
                    text=True,
                    timeout=remaining + 120,
                )
                for line in finished.stdout.splitlines():
                    self.log(line)
                problem = None if finished.returncode == 0 else (
                    f"the {process} process exited with code {finished.returncode}: "
                    + " | ".join(finished.stderr.strip().splitlines()[-3:])
                )
            except subprocess.TimeoutExpired:
                problem = f"the {process} process ran past {remaining + 120:.0f} s and was stopped"
            # Written after every job, so a process that died later still
            # brings back what it finished.
            answers = json.loads(result_path.read_text()) if result_path.exists() else {}
        results: dict[str, dict[str, Measurement]] = {}
        for case, names in jobs:
            got = answers.get(case.id, {})
            results[case.id] = {}
            for name in names:
                if name in got:
                    results[case.id][name] = Measurement(**got[name])
                else:
                    missing = Measurement(name, process)
                    missing.stop("not run", problem or f"the {process} process did not reach this case")
                    results[case.id][name] = missing
        return results

    def results(self, case: Case) -> dict[str, Measurement] | None:
        return self._results.get(case.id)

    def finish(self) -> Path:
        """Write `bench_cases.json` into the run directory: the run's facts
        and every case, measured or not."""
        self.clocks.append(clock_note(self.device))
        cases = []
        for case in self.cases:
            results = self._results.get(case.id)
            if results is None:
                results = {name: Measurement(name, CONTENDERS[name].process) for name in case.contenders}
                for measurement in results.values():
                    measurement.stop("not run", "not reached (deselected, or the run stopped before it)")
            cases.append({
                **case.facts(),
                "order": self._orders.get(case.id, []),
                "results": {name: asdict(m) for name, m in results.items()},
            })
        facts = {
            "profile": self.profile.name,
            "profile_what": self.profile.what,
            "headline_bytes": self.profile.headline_bytes,
            "device": str(self.device),
            "device_description": vmm.driver_for(self.device).describe(),
            "granularity": vmm.driver_for(self.device).granularity,
            "partial_map": self.partial_map,
            "partial_access": self.partial_access,
            "host": socket.gethostname(),
            "torch": torch.__version__,
            "clocks": self.clocks,
            "rounds": self.rounds,
            "rounds_given": self.rounds_given,
            "case_seconds": self.profile.case_seconds,
            "headline_rounds": 0 if self.rounds_given else self.profile.headline_rounds,
            "headline_case_seconds": self.profile.headline_case_seconds,
            "growth_headline_rounds": 0 if self.rounds_given else self.profile.growth_headline_rounds,
            "growth_headline_case_seconds": self.profile.growth_headline_case_seconds,
            "headline_readings": HEADLINE_READINGS,
            "small_case_rounds": 0 if self.rounds_given else self.profile.small_case_rounds,
            "small_case_bytes": self.profile.small_case_bytes,
            "costly_rounds": self.profile.costly_rounds,
            "costly_contenders": [name for name, contender in CONTENDERS.items() if contender.costly],
            "budget_seconds": self.budget_seconds,
            "elapsed_seconds": self.elapsed(),
            "cpu_time": (
                "thread_time of the calling thread, up to the final device synchronize (excluded); extkv's own CPU "
                "(outside driver calls), and the raw sequence's as its yardstick, from an extra round per round of "
                "each recycled commit, with every driver "
                "step and the driver's batch setup (CUDA: context push and pop, stream lookup) timed, so that "
                "timing never weighs on the rounds the ratios come from; to time each step, extkv's extra round "
                "maps a commit's runs step by step, as a wrapped driver does, not in the CUDA driver's own loop, "
                "which does a subset of that Python: its own CPU reads high, if anything; at the two ends of "
                "the one-segment series (the smallest and largest size), further clocked rounds end every "
                f"driver step of the commit by writing {2 * largest_cpu_cache_bytes() // MiB} MiB "
                "(twice the CPU's largest cache, inside the step's time), so the Python after each step runs "
                "from equally cold caches at both sizes, and run both sizes of extkv and of the raw sequence "
                "interleaved round by round, so both sizes meet the same machine in equal numbers; clocked "
                "rounds run pinned to the CPU they start on"
            ),
            "contenders": {name: {"role": c.role, "what": c.describe(), "process": c.process} for name, c in CONTENDERS.items()},
            "geometries": {name: g.what for name, g in GEOMETRIES.items()},
            "cases": cases,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / CASES_FILE
        path.write_text(json.dumps(facts, indent=1))
        return path


def _serve(request_path: str, result_path: str) -> None:
    """Run the jobs of a request written by `Engine._in_subprocess`."""
    torch.set_num_threads(int(os.environ.get("EXTKV_TORCH_THREADS", "1")))
    request = json.loads(Path(request_path).read_text())
    profile = PROFILES[request["profile"]]
    device = vmm.canonical_device(request["device"])
    by_id = {case.id: case for case in catalogue(profile)}
    deadline = time.perf_counter() + request["seconds"]
    process = request["process"]
    answers: dict[str, dict[str, dict]] = {}
    for job in request["jobs"]:
        if time.perf_counter() > deadline:
            break
        case = by_id[job["case"]]
        if process == "fresh":
            # 4 MiB used and given back: first-call costs stay out of the
            # case, and the memory it measures on is still never used.
            warm_up(device, job["contenders"], [case.op])
            results = measure_fresh(case, job["contenders"], device)
        else:
            results = interleave(
                case,
                job["contenders"],
                device,
                rounds=request["rounds"],
                case_seconds=profile.case_seconds,
                costly_rounds=profile.costly_rounds,
                process=process,
            )
        answers[case.id] = {name: asdict(m) for name, m in results.items()}
        print(f"bench ({process} process) {case.id}: " + ", ".join(m.summary() for m in results.values()), flush=True)
        # Written after every job: a crash later still returns the rest.
        Path(result_path).write_text(json.dumps(answers))
    Path(result_path).write_text(json.dumps(answers))


if __name__ == "__main__":
    _serve(*sys.argv[1:3])
