"""`extkv check` on an oversubscribed machine: the verdict must hold there too.

Theory of operation
-------------------
A certificate says extkv keeps its invariants on this machine, and machines
are shared: other jobs take the CPUs and move the free memory. This script
makes such a machine, then runs the check on it:

- CPU burners: `--burners` processes (default twice the cores this process
  may use), each a busy loop, so every test thread waits for a core;
- a memory neighbour: maps anonymous memory, writes every page, holds it a
  moment and unmaps it, again and again, up to `--memory-bytes` (default
  the smaller of 2 GiB and a tenth of MemTotal, far from the machine's
  limit), so free memory moves between any two readings;
- where torch sees CUDA, a GPU neighbour per GPU doing the same with torch
  allocations of up to `--gpu-bytes` (default the smaller of 8 GiB and a
  tenth of the GPU; 0: none).

It then runs `python -m extkv check` `--runs` times (default 3) with every
argument it does not know, passes its output through, prints each run's
verdict (its last `extkv check:` line) and exits 0 only when every run was
certified. Each run writes its own report directory, so pass no
`--report-dir`.

The neighbours share one process group of their own, killed as a whole on
every way out: the end, an error, Ctrl-C (the terminal's SIGINT reaches the
check, in the foreground group with this script; the neighbours are killed
here), SIGTERM and SIGHUP. A neighbour whose parent died without that (a
SIGKILL) notices, and exits.

    PYTHONPATH=. python3 -m tools.busy_check            # 3 full runs
    PYTHONPATH=. python3 tools/busy_check.py --runs 1 --burners 2 -k sizing
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

MiB, GiB = 1 << 20, 1 << 30

#: Each neighbour runs while the process that started it, named by its
#: first argument (read at its start, it could already be gone), lives: a
#: killed script leaves no burner behind.
BURNER = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""

MEMORY_NEIGHBOUR = """
import mmap, os, random, sys, time
parent, bound, rng = int(sys.argv[1]), int(sys.argv[2]), random.Random()
piece = b"\\1" * (1 << 20)
while os.getppid() == parent:
    size = max(rng.randrange(bound // 8, bound + 1) // len(piece), 1) * len(piece)
    held = mmap.mmap(-1, size)
    for offset in range(0, size, len(piece)):  # written, so the kernel really gives every page
        held[offset : offset + len(piece)] = piece
    time.sleep(rng.uniform(0, 0.5))
    held.close()
    time.sleep(rng.uniform(0, 0.5))
"""

GPU_NEIGHBOUR = """
import os, random, sys, time
import torch
parent, bound, device, rng = int(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3]), random.Random()
bound = min(bound, torch.cuda.get_device_properties(device).total_memory // 10)
while os.getppid() == parent:
    try:
        held = torch.ones(rng.randrange(bound // 8, bound + 1), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:  # a test filled the GPU: press again later
        held = None
    time.sleep(rng.uniform(0, 0.5))
    del held
    torch.cuda.empty_cache()
    time.sleep(rng.uniform(0, 0.5))
"""

CUDA_DEVICES = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def memory_bound(total_bytes: int) -> int:
    """What the memory neighbour holds at most: 2 GiB, or a tenth of the machine if less."""
    return min(2 * GiB, total_bytes // 10)


def mem_total() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def cuda_devices() -> int:
    """GPUs torch sees, asked in a child so that this process holds no CUDA context."""
    found = subprocess.run([sys.executable, "-c", CUDA_DEVICES], capture_output=True, text=True, check=False)
    return int(found.stdout.split()[-1]) if found.returncode == 0 and found.stdout.split() else 0


class Neighbourhood:
    """The burners and neighbours, in one process group of their own."""

    def __init__(self, burners: int, memory_bytes: int, gpu_bytes: int, gpus: int):
        self.burners, self.memory_bytes, self.gpu_bytes, self.gpus = burners, memory_bytes, gpu_bytes, gpus
        self.processes: list[subprocess.Popen] = []
        self.pgid: int | None = None

    def _start(self, code: str, *arguments: object) -> None:
        group = self.pgid or 0  # the first one leads the group, the others join it

        def join_group() -> None:
            os.setpgid(0, group)

        process = subprocess.Popen(
            [sys.executable, "-c", code, str(os.getpid()), *map(str, arguments)], stdin=subprocess.DEVNULL, preexec_fn=join_group
        )
        self.processes.append(process)
        self.pgid = self.pgid or process.pid

    def __enter__(self) -> Neighbourhood:
        try:
            for _ in range(self.burners):
                self._start(BURNER)
            if self.memory_bytes:
                self._start(MEMORY_NEIGHBOUR, self.memory_bytes)
            for gpu in range(self.gpus if self.gpu_bytes else 0):
                self._start(GPU_NEIGHBOUR, self.gpu_bytes, f"cuda:{gpu}")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.processes:
            process.wait()

    def describe(self) -> str:
        gpus = f", a GPU neighbour up to {self.gpu_bytes // MiB} MiB on each of {self.gpus} GPUs" if self.gpus and self.gpu_bytes else ""
        return (
            f"{self.burners} CPU burners on {len(os.sched_getaffinity(0))} cores, a memory neighbour up to "
            f"{self.memory_bytes // MiB} MiB{gpus}; process group {self.pgid}"
        )


def run_check(command: list[str]) -> tuple[bool, str]:
    """Run one check, its output passed through; whether it certified, and its verdict line."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    verdict = "no verdict line"
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            if line.startswith("extkv check: "):
                verdict = line.rstrip("\n")
        returncode = process.wait()
    finally:
        if process.poll() is None:  # interrupted here: the check goes too
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return returncode == 0 and verdict.startswith("extkv check: CERTIFIED"), verdict


def stop_on(signum: int, _frame) -> None:
    """SIGTERM and SIGHUP end the script as Ctrl-C does: through the cleanup."""
    raise SystemExit(128 + signum)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="busy_check", allow_abbrev=False,
        description="Run `extkv check` on an oversubscribed machine; other arguments go to extkv check.",
    )
    parser.add_argument("--runs", type=int, default=3, help="checks to run (default 3)")
    parser.add_argument("--burners", type=int, default=2 * len(os.sched_getaffinity(0)), help="CPU burners (default 2x cores)")
    parser.add_argument("--memory-bytes", type=int, default=memory_bound(mem_total()),
                        help="most the memory neighbour holds (default min(2 GiB, MemTotal / 10); 0: none)")
    parser.add_argument("--gpu-bytes", type=int, default=8 * GiB,
                        help="most each GPU neighbour holds (default 8 GiB, at most a tenth of the GPU; 0: none)")
    args, extra = parser.parse_known_args(argv)
    for name in ("runs", "burners", "memory_bytes", "gpu_bytes"):
        if getattr(args, name) < (1 if name == "runs" else 0):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'runs' else '>= 0'}, got {getattr(args, name)}")
    if args.memory_bytes > memory_bound(mem_total()):
        parser.error(f"--memory-bytes {args.memory_bytes} is past min(2 GiB, MemTotal / 10) = {memory_bound(mem_total())}")
    return args, extra


def main(argv: list[str] | None = None, check: list[str] | None = None) -> int:
    """`check`: the command to run instead of `python -m extkv check` (its tests)."""
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    command = (check or [sys.executable, "-m", "extkv", "check"]) + extra
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on)
    verdicts: list[tuple[bool, str]] = []
    try:
        with Neighbourhood(args.burners, args.memory_bytes, args.gpu_bytes, cuda_devices() if args.gpu_bytes else 0) as busy:
            print(f"busy_check: {busy.describe()}", flush=True)
            for number in range(1, args.runs + 1):
                print(f"busy_check: run {number}/{args.runs}: {' '.join(command)}", flush=True)
                verdicts.append(run_check(command))
    except KeyboardInterrupt:
        print("busy_check: interrupted; the neighbours are gone", flush=True)
        return 130
    finally:
        for number, (_, verdict) in enumerate(verdicts, 1):
            print(f"busy_check: run {number}/{args.runs}: {verdict}", flush=True)
    certified = sum(ok for ok, _ in verdicts)
    print(f"busy_check: {certified} of {args.runs} runs certified under load", flush=True)
    return 0 if certified == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
