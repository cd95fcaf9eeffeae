"""Whether resetting Dynamo beside threads that run compiled code crashes the process.

Ranks run as threads (``dtcompile.testing.run_threaded``) share one Dynamo.  CI's torch
2.13 worker once died of a segmentation fault in a test whose rank threads each called
``torch._dynamo.reset()`` between two compiles.  Each run here is a fresh process:

- ``stock``: two threads call a compiled function (``backend="eager"``) in a loop while the
  main thread calls ``torch._dynamo.reset()`` in a loop, for at most ``--seconds``;
- ``rank_resets``: as ``every_rank`` below, but each rank thread calls ``torch._dynamo.reset()``
  itself, as that test did (``run_threaded`` refuses it: the run ends with its error);
- ``every_rank``: two rank threads of ``run_threaded`` compile and call the same function,
  then call ``dtcompile.testing.reset_dynamo_on_every_rank()`` (rank 0 resets while the
  other waits), in a loop for ``--seconds``.

A run crashes when its process ends by a signal.  The table gives runs, crashes, and the
median seconds to the crash (the process's start, about 4 s of imports, included).

    python benchmarks/threaded_reset_crash.py --runs 5 --seconds 20
    PYTHONPATH=<a checkout from before the refusal> python benchmarks/threaded_reset_crash.py rank_resets
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_STOCK = """
import threading, time, sys
import torch, torch._dynamo

def f(x, y):
    return (x @ y).relu() + 1

def calls(stop):
    compiled = torch.compile(f, backend="eager")
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    while not stop.is_set():
        compiled(x, y)

stop = threading.Event()
threads = [threading.Thread(target=calls, args=(stop,)) for _ in range(2)]
for thread in threads:
    thread.start()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    torch._dynamo.reset()
stop.set()
for thread in threads:
    thread.join()
"""

_RANK_LOOP = """
import time, sys
import torch
from dtcompile.testing import run_threaded

def f(x, y):
    return (x @ y).relu() + 1

def rank_loop(rank, seconds):
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    end, rounds = time.monotonic() + seconds, 0
    while True:
        compiled = torch.compile(f, backend="eager")
        for _ in range(50):
            compiled(x, y)
        RESET
        rounds += 1
        # Every rank stops after the same round: rank 0 decides, the others follow.
        done = torch.tensor([float(time.monotonic() >= end)])
        torch.distributed.broadcast(done, 0)
        if done.item():
            return rounds

print(run_threaded(2, rank_loop, float(sys.argv[1]), timeout=float(sys.argv[1]) + 120))
"""

PROGRAMS = {
    "stock": _STOCK,
    # As the failing test did: every rank thread resets Dynamo itself (refused now; it runs
    # on checkouts from before the refusal too, with PYTHONPATH set to one).
    "rank_resets": _RANK_LOOP.replace("RESET", "torch._dynamo.reset()"),
    "every_rank": _RANK_LOOP.replace(
        "RESET", "from dtcompile.testing import reset_dynamo_on_every_rank; reset_dynamo_on_every_rank()"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("programs", nargs="*", help=f"of {', '.join(PROGRAMS)} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.programs) - set(PROGRAMS))
    if unknown:
        parser.error(f"unknown programs {unknown}; choose from {', '.join(PROGRAMS)}")
    args.programs = args.programs or list(PROGRAMS)
    import torch

    print(f"torch {torch.__version__}, {args.runs} runs of at most {args.seconds:g} s each")
    print("| program | runs | crashed | median s to the crash | the others |")
    print("|---|---:|---:|---:|---|")
    for name in args.programs:
        program = PROGRAMS[name]
        crash_s, ends, rounds = [], [], []
        for _ in range(args.runs):
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-c", program, str(args.seconds)], capture_output=True, text=True,
                                  timeout=args.seconds + 300)
            if proc.returncode < 0:
                crash_s.append(time.monotonic() - start)
            elif proc.returncode == 0:
                ends.append("exit 0")
                if name != "stock":
                    rounds.append(int(proc.stdout.split("[", 1)[1].split(",", 1)[0]))
            else:
                error = next((line for line in proc.stderr.splitlines() if "RuntimeError: torch._dynamo.reset()" in line), "")
                ends.append(f"exit {proc.returncode}" + (", refused by run_threaded" if error else ""))
        median = f"{statistics.median(crash_s):.1f}" if crash_s else "-"
        others = "; ".join(f"{end} x{ends.count(end)}" for end in dict.fromkeys(ends)) or "-"
        if rounds:
            others += f", {min(rounds)}-{max(rounds)} rounds (a compile, 50 calls, a reset) per run"
        print(f"| {name} | {args.runs} | {len(crash_s)} | {median} | {others} |")


if __name__ == "__main__":
    main()
