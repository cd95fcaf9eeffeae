"""Tracing at a large fake world costs what it costs at a small one.

The 2-D block (tensor + sequence parallel over ``tp``, data parallel over
``dp``) is compiled with dtcompile (Dynamo + AOTAutograd + passes, no Inductor:
what is timed is tracing) for one training step on the fake process group, at
world 8 (mesh 2 x 4) and at world 8192 (mesh 64 x 128).  The model is the same
at both sizes (dim 1024, 128 heads, hidden 2048, seq 128, one sequence per dp rank); only the
mesh differs, so the local shapes shrink with it.  Each world runs in a fresh
process; time is wall clock of the first (compiling) step minus a warm step,
memory is the process's peak RSS growth during that step (``ru_maxrss``).

    python benchmarks/large_world.py
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORLDS = {8: (2, 4), 8192: (64, 128)}


def _child(world_size: int) -> dict[str, float]:
    import torch

    import dtcompile
    from dtcompile._testing.cases import CASES, run_step
    from dtcompile._testing.models import BlockArgs, build_block_2d
    from dtcompile.testing import fake_world

    args = BlockArgs(dim=1024, n_heads=128, hidden=2048)
    case = CASES["block_2d"]
    start = time.perf_counter()
    with fake_world(world_size, WORLDS[world_size], ("dp", "tp")) as mesh:
        mesh_s = time.perf_counter() - start
        _, parallel, x = build_block_2d(mesh, batch=1, seq=128, args=args)
        local_x = case.local_input(x, mesh)
        backend = dtcompile.backend(inductor=False)
        compiled = torch.compile(parallel, backend=backend, fullgraph=True)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        run_step(compiled, parallel, local_x)
        first = time.perf_counter() - start
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        run_step(compiled, parallel, local_x)
        warm = time.perf_counter() - start
        return {
            "mesh_s": mesh_s,
            "trace_s": first - warm,
            "peak_growth_mib": (rss_after - rss_before) / 1024,
            "peak_rss_mib": rss_after / 1024,
            "graphs": len(backend.records),
            "local_x": list(local_x.shape),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    if opts.child:
        warnings.simplefilter("ignore")
        print(json.dumps(_child(opts.child)))
        return
    runs: dict[int, list[dict[str, float]]] = {w: [] for w in WORLDS}
    for _ in range(opts.repeats):
        for world_size in WORLDS:  # alternate, each in a fresh process
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(world_size)],
                check=True, capture_output=True, text=True,
            )
            runs[world_size].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"2-D block, one compiled training step, fake PG; best of {opts.repeats} fresh processes")
    print(f"{'world':>6} {'mesh':>9} {'mesh init s':>12} {'trace s':>8} {'peak RSS growth MiB':>20} {'peak RSS MiB':>13} {'graphs':>7} {'local input':>14}")
    best = {w: min(r, key=lambda run: run["trace_s"]) for w, r in runs.items()}
    for world_size, run in best.items():
        shape = "x".join(map(str, WORLDS[world_size]))
        print(
            f"{world_size:>6} {shape:>9} {run['mesh_s']:>12.2f} {run['trace_s']:>8.2f} {run['peak_growth_mib']:>20.0f} "
            f"{run['peak_rss_mib']:>13.0f} {run['graphs']:>7} {run['local_x']!s:>14}"
        )
    small, large = best[8], best[8192]
    print(f"ratio 8192 / 8: trace time {large['trace_s'] / small['trace_s']:.2f}x, peak RSS {large['peak_rss_mib'] / small['peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
