"""Runs a flaky-looking command many times with both cores busy, and counts how it ends.

Two commands that failed once each, and then passed, are run here under load until
they either fail again (and their whole output is kept) or are shown not to:

- ``torchrun``: ``examples/train_torchrun.py`` compiled on two gloo ranks (``--standalone``,
  4 steps), as ``tests/e2e/test_torchrun.py`` launches it; once, rank 1 aborted at exit
  (``terminate called without an active exception``) after four good steps.
- ``simple_fsdp``: ``tests/clients/test_torchtitan_simple_fsdp.py -k fsdp`` under pytest-xdist
  (``-n 2``), as CI runs it; it failed once on torch 2.13 and passed alone.

Load: one busy-looping process per core (``--load``), so that the runs compete for the
CPUs as they do when the test suite runs on both cores.  Each failure's output is written
to ``--out`` and its last lines printed; the table gives runs, failures, and the median
seconds per run.

    python benchmarks/soak_flakes.py --runs 20 torchrun simple_fsdp
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "torchrun": [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(ROOT / "examples" / "train_torchrun.py"), "--steps", "4",
    ],
    "simple_fsdp": [
        sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
        str(ROOT / "tests" / "clients" / "test_torchtitan_simple_fsdp.py"), "-k", "fsdp",
    ],
}
# What a run must print to count as a pass besides exiting 0 (a run that printed nothing passed nothing).
PASSED = {"torchrun": "step 4 loss", "simple_fsdp": " passed"}
# Output that is a failure even where the exit code is 0.
FAILED = ("terminate called", "waitForInput", "Traceback")


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", choices=sorted(COMMANDS))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes beside the runs")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak_flakes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # an abort prints its threads
    rows = []
    for name in args.names:
        hogs = [multiprocessing.Process(target=_spin, args=(time.monotonic() + 24 * 3600,), daemon=True) for _ in range(args.load)]
        for hog in hogs:
            hog.start()
        seconds, failures = [], []
        try:
            for run in range(args.runs):
                start = time.monotonic()
                proc = subprocess.run(COMMANDS[name], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
                seconds.append(time.monotonic() - start)
                out = proc.stdout + proc.stderr
                bad = [marker for marker in FAILED if marker in out]
                if proc.returncode != 0 or PASSED[name] not in out or bad:
                    path = args.out / f"{name}-{run}.log"
                    path.write_text(f"exit {proc.returncode}; markers {bad}\n{out}")
                    failures.append((run, proc.returncode, bad, path))
                    print(f"{name} run {run}: exit {proc.returncode}, {bad}; full output in {path}", flush=True)
                    print("\n".join(out.splitlines()[-15:]), flush=True)
                else:
                    print(f"{name} run {run}: passed ({seconds[-1]:.0f} s)", flush=True)
        finally:
            for hog in hogs:
                hog.kill()
        rows.append((name, args.runs, len(failures), statistics.median(seconds)))
    print(f"\n| command | runs | failed | median s/run |  (load: {args.load} busy processes)")
    print("|---|---:|---:|---:|")
    for name, runs, failed, median in rows:
        print(f"| {name} | {runs} | {failed} | {median:.0f} |")


if __name__ == "__main__":
    main()
