"""Auto-parallel on HuggingFace models: plan time on two meshes, and the plan against transformers' own.

For every model of the HF zoo (``tests/support/hf_models.py``: 20 transformers
families, tiny configs, random init), on the fake process group:

- **plan s**: ``dtcompile.auto_parallel.plan`` on a 1-D mesh of 4 (``tp``) and on 2 x 2
  (``dp`` x ``tp``), under half the replicated parameter bytes, one after another in this
  process (measurements of ops already seen on a mesh are reused, as in a user's session);
- **HF plan us / dtcompile us**: on the 1-D mesh, transformers' own tensor-parallel plan
  (``base_model_tp_plan`` and the head's, as torch ``parallelize_module`` styles) and
  dtcompile's plan under the same parameter bytes per rank, input and logits replicated as
  in the HF plan; each compiled with dtcompile (no Inductor), forward and backward played
  by ``dtcompile.cost.simulate`` under the ``h100`` profile; with the number of collectives in the
  compiled graphs (bucketing off).  ``-`` where transformers has no plan, or one torch's
  styles cannot express (MoE expert packing), or that fails in eager (GQA: 2 KV heads over 4 ranks);
- **peak RSS**: the process's peak resident memory so far (``ru_maxrss``; it only grows).

    python benchmarks/hf_zoo.py [--models llama,gpt2]

``--stages``: instead, each model planned cold (a fresh process per model, nothing measured
before it) on 2 x 2 (world 4) and 2 x 4 (world 8), one after the other, then applied: seconds
per stage (trace, strategies, measure, edges, solve, apply), the program's variables, the
plan's estimated step (objective) and the process's peak RSS so far, and plans per minute over the run.  It reads only what every
version of the planner records (``solution.problem.seconds``), so the same command times an
older checkout (``git worktree``) for a before/after table.

    python benchmarks/hf_zoo.py --stages --models llama,mistral,qwen2,gpt2,gpt_neox,phi3,gemma,bert

``--models`` also takes the wider families outside the zoo (``support.hf_models.HF_WIDER``: ``opt``,
``bloom``, ``swin``...); transformers' own plan is compared where the family has one.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/support: the HF zoo

from support.hf_models import HF_ZOO, NoTorchEquivalent, against_hf_plan, build, plan_hf  # noqa: E402

from dtcompile.testing import fake_world  # noqa: E402

MESHES = {"1-D 4": ((4,), ("tp",)), "2 x 2": ((2, 2), ("dp", "tp"))}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


STAGE_MESHES = {"2 x 2": (4, (2, 2)), "2 x 4": (8, (2, 4))}
STAGES = ("trace", "strategies", "measure", "edges", "solve", "apply")


def _plan_stages(name: str) -> None:
    """Plan ``name`` on each of :data:`STAGE_MESHES` in this (fresh) process; one JSON line per mesh."""
    from dtcompile.auto_parallel import parallelize

    model, args = build(name)
    for mesh_name, (world, shape) in STAGE_MESHES.items():
        with fake_world(world, shape, ("dp", "tp")) as mesh:
            start = time.perf_counter()
            solution = plan_hf(model, args, mesh)
            applied = time.perf_counter()
            parallelize(model, solution)
            end = time.perf_counter()
        seconds = dict(solution.problem.seconds, apply=end - applied)
        print(json.dumps({"mesh": mesh_name, "total": end - start, "seconds": seconds,
                          "variables": solution.result.num_variables, "objective": solution.result.objective_us,
                          "peak_mib": _peak_mib()}))


def stages(names: list[str]) -> None:
    print("| model | mesh | total s | " + " | ".join(f"{s} s" for s in STAGES) + " | variables | step us | peak RSS MiB |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in STAGES) + " | ---: | ---: | ---: |")
    begun, plans = time.perf_counter(), 0
    for name in names:
        child = subprocess.run([sys.executable, __file__, "--plan-stages", name], capture_output=True, text=True)
        rows = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        if child.returncode or not rows:
            print(f"| {name} | - | failed: {child.stderr.strip().splitlines()[-1:]} |", flush=True)
            continue
        for row in rows:
            plans += 1
            cells = " | ".join(f"{row['seconds'].get(s, 0.0):.2f}" for s in STAGES)
            print(f"| {name} | {row['mesh']} | {row['total']:.2f} | {cells} | {row['variables']} | {row['objective']:.4f} "
                  f"| {row.get('peak_mib', 0):.0f} |", flush=True)
    minutes = (time.perf_counter() - begun) / 60
    print(f"\n{plans} plans in {minutes * 60:.0f} s with a fresh process per model (imports included): "
          f"{plans / minutes:.1f} plans per minute")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(HF_ZOO), help="comma-separated zoo (or HF_WIDER) names")
    parser.add_argument("--stages", action="store_true", help="seconds per planning stage, cold, on 2 x 2 and 2 x 4")
    parser.add_argument("--plan-stages", help=argparse.SUPPRESS)  # the child --stages runs per model
    options = parser.parse_args()
    if options.plan_stages:
        warnings.filterwarnings("ignore")
        return _plan_stages(options.plan_stages)
    names = options.models.split(",")
    if options.stages:
        return stages(names)
    warnings.filterwarnings("ignore")
    print("| model | plan s, 1-D 4 | plan s, 2 x 2 | HF plan us | dtcompile us | dtcompile / HF | collectives HF / dtcompile | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cheaper = compared = 0
    for name in names:
        model, args = build(name)
        seconds = []
        for shape, axes in MESHES.values():
            with fake_world(4, shape, axes) as mesh:
                start = time.perf_counter()
                plan_hf(model, args, mesh)
                seconds.append(time.perf_counter() - start)
        try:
            r = against_hf_plan(name)
        except NoTorchEquivalent as e:
            cells = [f"- ({e})", "-", "-", "-"]
        else:
            compared += 1
            cheaper += r.auto_us <= r.hf_us * (1 + 1e-9)
            cells = [f"{r.hf_us:.2f}", f"{r.auto_us:.2f}", f"{r.auto_us / r.hf_us:.3f}", f"{r.hf_collectives} / {r.auto_collectives}"]
        print(f"| {name} | {seconds[0]:.1f} | {seconds[1]:.1f} | " + " | ".join(cells) + f" | {_peak_mib():.0f} |", flush=True)
    print(f"\n{len(names)} of {len(names)} models planned on both meshes; dtcompile's plan no dearer than "
          f"transformers' in {cheaper} of {compared} compared")


if __name__ == "__main__":
    main()
