"""The solver's first try with and without HiGHS's feasibility-jump heuristic, on every zoo program.

``dtcompile.auto_parallel.solver._run`` solves a reduced program first without HiGHS's
presolve and without its feasibility-jump heuristic, up to 100 branch-and-bound nodes,
then with both where that did not finish.  This plans each model of the zoo
(``tests/support/zoo_models.py``, on a 1-D mesh of 4 and on 2 x 2) and of the HF zoo
(``tests/support/hf_models.py``, on 4, 2 x 2 and 2 x 4) on the fake process group, under
half the replicated parameter bytes, takes the program the plan solved, and solves it
again twice each way (the heuristic off, as the planner runs it, and on), best of two: the
seconds, HiGHS's status, nodes and objective per program, a mark where the objectives
differ, and the sums.

    python benchmarks/solver_heuristics.py [--models llama,gpt2] [--zoo-only]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/support: the zoos

import numpy as np  # noqa: E402
from support import hf_models, zoo_models  # noqa: E402
from support.ap_cases import KEPT_GATHERED, sharded_budget  # noqa: E402

import dtcompile  # noqa: E402
from dtcompile.auto_parallel import solver  # noqa: E402
from dtcompile.testing import fake_world  # noqa: E402

MESHES = {"4": ((4,), ("tp",)), "2 x 2": ((2, 2), ("dp", "tp")), "2 x 4": ((2, 4), ("dp", "tp"))}
# An option name HiGHS does not know: setting it fails, and the heuristic keeps its default (on).
_LEFT_ON = "benchmark_no_such_option"


def _program(model, args, mesh_name):
    """The program ``plan`` solved first (the reduced one), and the families it left out."""
    captured = []
    run = solver._run

    def capture(program, time_limit_s, skip=frozenset()):
        captured.append((program, skip))
        return run(program, time_limit_s, skip)

    solver._run = capture
    try:
        shape, names = MESHES[mesh_name]
        with fake_world(int(np.prod(shape)), shape, names) as mesh:
            dtcompile.auto_parallel.plan(model, mesh, args, param_memory_budget_bytes=sharded_budget(model),
                                         config=KEPT_GATHERED)
    finally:
        solver._run = run
    return captured[0]


def _solve(program, skip, option):
    """Best of two solves with the first try's heuristic option named ``option``."""
    kept, solver._FEASIBILITY_JUMP = solver._FEASIBILITY_JUMP, option
    try:
        best = None
        for _ in range(2):
            start = time.perf_counter()
            h, status = solver._run(program, 600.0, skip)
            seconds = time.perf_counter() - start
            if best is None or seconds < best[0]:
                info = h.getInfo()
                best = (seconds, h.modelStatusToString(status), info.mip_node_count, info.objective_function_value)
        return best
    finally:
        solver._FEASIBILITY_JUMP = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names of either zoo (default: all)")
    parser.add_argument("--zoo-only", action="store_true", help="the zoo's models only (faster)")
    args = parser.parse_args()
    chosen = set(args.models.split(",")) if args.models else None
    cases = [("zoo", n, m) for n in zoo_models.ZOO for m in ("4", "2 x 2")]
    if not args.zoo_only:
        cases += [("hf", n, m) for n in hf_models.HF_ZOO for m in MESHES]
    print("| zoo | model | mesh | off s | off status | off nodes | on s | on status | on nodes | objective | same |")
    print("|---|---|---|---:|---|---:|---:|---|---:|---:|---|")
    sums = {"off": 0.0, "on": 0.0}
    differ = 0
    for kind, name, mesh_name in cases:
        if chosen is not None and name not in chosen:
            continue
        model, example = zoo_models.build(name) if kind == "zoo" else hf_models.build(name)
        try:
            program, skip = _program(model, example, mesh_name)
        except Exception as e:  # a model this torch or transformers cannot run (MoE on CPU fp32)
            print(f"| {kind} | {name} | {mesh_name} | - | {type(e).__name__} | | | | | | |")
            continue
        off = _solve(program, skip, "mip_heuristic_run_feasibility_jump")
        on = _solve(program, skip, _LEFT_ON)
        same = off[1] == on[1] and abs(off[3] - on[3]) <= 1e-6 * max(1.0, abs(on[3]))
        differ += not same
        sums["off"] += off[0]
        sums["on"] += on[0]
        print(f"| {kind} | {name} | {mesh_name} | {off[0]:.3f} | {off[1]} | {off[2]} | {on[0]:.3f} | {on[1]} | {on[2]} | "
              f"{on[3]:.6f} | {'yes' if same else 'NO'} |", flush=True)
    print(f"\nsolve seconds summed: heuristic off {sums['off']:.2f}, on {sums['on']:.2f}; "
          f"programs whose status or objective differ: {differ}")


if __name__ == "__main__":
    main()
